"""ReqToTokenPool, SlotAllocator and KVCache: accounting, exhaustion and recovery, strict checks."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_hal import ContractError
from ngram_hal.kv_cache import KVCache, free_device_bytes
from ngram_hal.memory import OutOfRowsError, OutOfSlotsError, ReqToTokenPool, SlotAllocator
from ngram_hal.reference import CpuBackend

I64 = torch.int64
PAGE_SIZES = [1, 4, 16]


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I64)


def free_list(alloc: SlotAllocator) -> list[int]:
    return alloc.free_list.tolist()


# ------------------------------------------------------------------ ReqToTokenPool


def test_pool_rows_alloc_free_and_exhaustion():
    pool = ReqToTokenPool(3, 8)
    assert pool.req_to_token.dtype == I64 and pool.req_to_token.shape == (3, 8)
    assert bool((pool.req_to_token == -1).all())
    rows = [pool.alloc() for _ in range(3)]
    assert sorted(rows) == [0, 1, 2] and pool.available() == 0
    with pytest.raises(OutOfRowsError, match="all 3 rows"):
        pool.alloc()
    assert pool.available() == 0
    pool.req_to_token[rows[1], :4] = t([5, 6, 7, 8])
    pool.free(rows[1])
    assert pool.available() == 1
    assert bool((pool.req_to_token[rows[1]] == -1).all())
    assert pool.alloc() == rows[1]


def test_pool_double_free_and_bad_rows_raise():
    pool = ReqToTokenPool(2, 4)
    row = pool.alloc()
    pool.free(row)
    with pytest.raises(ContractError, match="double free"):
        pool.free(row)
    with pytest.raises(ContractError, match="outside"):
        pool.free(7)
    with pytest.raises(ContractError, match="Python int"):
        pool.free(torch.tensor(0))
    assert pool.available() == 2


def test_pool_rejects_bad_sizes():
    with pytest.raises(ContractError, match="'size'"):
        ReqToTokenPool(0, 4)
    with pytest.raises(ContractError, match="'max_context_len'"):
        ReqToTokenPool(2, 2.5)


# ------------------------------------------------------------------ SlotAllocator


def test_allocator_accounting_and_layout():
    alloc = SlotAllocator(CpuBackend(), 70, page_size=16)
    assert alloc.num_pages == 4 and alloc.num_slots == 64 and alloc.available() == 64
    locs = alloc.alloc(20)
    assert locs.dtype == I64 and locs.shape == (20,)
    assert locs.tolist() == list(range(20))
    assert alloc.available() == 32 and alloc.free_pages == 2


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_exhaustion_and_recovery(page_size):
    alloc = SlotAllocator(CpuBackend(), 8 * page_size, page_size)
    n = 3 * page_size - page_size // 2  # three pages, the last one partly used
    chunks = []
    while True:
        state = (free_list(alloc), alloc.available())
        try:
            chunks.append(alloc.alloc(n))
        except OutOfSlotsError as err:
            assert err.needed == 3 * page_size and err.free == 2 * page_size
            assert f"{3 * page_size} needed, {2 * page_size} free" in str(err)
            assert isinstance(err, RuntimeError)
            break
    assert len(chunks) == 2
    assert (free_list(alloc), alloc.available()) == state
    alloc.free(chunks[0])
    assert alloc.available() == 5 * page_size
    again = alloc.alloc(n)
    # Free pages are used oldest first: the two never used, then the first one given back.
    pages = sorted({loc // page_size for loc in again.tolist()})
    assert pages == sorted(state[0] + [int(chunks[0][0]) // page_size])
    assert alloc.available() == 2 * page_size


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_extend_out_of_slots_changes_nothing(page_size):
    backend = CpuBackend()
    alloc = SlotAllocator(backend, 4 * page_size, page_size)
    first = alloc.alloc_extend(t([0]), t([page_size + 1]), t([-1]), [0], [page_size + 1])
    state = free_list(alloc)
    last = int(first[-1])
    with pytest.raises(OutOfSlotsError) as info:
        # Needs the rest of its page plus 3 more pages: 2 are free.
        alloc.alloc_extend(t([page_size + 1]), t([5 * page_size]), t([last]), [page_size + 1], [5 * page_size])
    assert info.value.needed == 3 * page_size and info.value.free == 2 * page_size
    assert free_list(alloc) == state
    # The request still fits when it asks for less.
    more = alloc.alloc_extend(t([page_size + 1]), t([4 * page_size]), t([last]), [page_size + 1], [4 * page_size])
    assert more.shape == (3 * page_size - 1,) and alloc.available() == 0


def test_alloc_extend_contract_error_leaks_nothing():
    alloc = SlotAllocator(CpuBackend(), 16)
    with pytest.raises(ContractError, match="alloc_extend.*'seq_lens'"):
        alloc.alloc_extend(t([0]), torch.tensor([4], dtype=torch.int32), t([-1]), [0], [4])
    with pytest.raises(ContractError, match="'seq_lens_host'"):
        alloc.alloc_extend(t([0]), t([4]), t([-1]), [0], [4, 5])
    with pytest.raises(ContractError, match="'prefix_lens_host'"):
        alloc.alloc_extend(t([0]), t([4]), t([-1]), [0.0], [4])
    with pytest.raises(ContractError, match="prefix_lens <= seq_lens"):
        alloc.alloc_extend(t([5]), t([4]), t([3]), [5], [4])
    assert alloc.available() == 16 and free_list(alloc) == list(range(16))


def test_strict_alloc_extend_checks_host_lengths_against_device():
    alloc = SlotAllocator(CpuBackend(strict=True), 16)
    with pytest.raises(ContractError, match="'seq_lens_host'.*differs"):
        alloc.alloc_extend(t([0]), t([4]), t([-1]), [0], [3])
    assert alloc.available() == 16


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_strict_double_free_raises_and_frees_nothing(page_size):
    alloc = SlotAllocator(CpuBackend(strict=True), 4 * page_size, page_size)
    a = alloc.alloc(page_size + 1)
    b = alloc.alloc(page_size)
    alloc.free(a)
    state = free_list(alloc)
    with pytest.raises(ContractError, match="SlotAllocator.free.*not allocated"):
        alloc.free(a)
    with pytest.raises(ContractError, match="not allocated"):
        alloc.free(torch.cat([b, a])[: page_size * 3])
    assert free_list(alloc) == state
    alloc.free(b)
    assert alloc.available() == 4 * page_size


def test_free_tail_from_page_boundary():
    alloc = SlotAllocator(CpuBackend(strict=True), 16, page_size=4)
    locs = alloc.alloc(10)
    alloc.free(locs[4:].contiguous())
    assert alloc.available() == 4 + 8
    alloc.free(locs[:4].contiguous())
    assert alloc.available() == 16


def test_strict_free_rejects_never_allocated_and_bad_slots():
    alloc = SlotAllocator(CpuBackend(strict=True), 8, page_size=4)
    alloc.alloc(4)
    with pytest.raises(ContractError, match="slot 4 is not allocated"):
        alloc.free(t([4, 5]))
    with pytest.raises(ContractError, match="outside"):
        alloc.free(t([8]))
    with pytest.raises(ContractError, match="from a page boundary"):
        alloc.free(t([1, 2]))  # not page-aligned: position 0 must sit at offset 0
    with pytest.raises(ContractError, match="distinct"):
        SlotAllocator(CpuBackend(strict=True), 8).free(t([3, 3]))
    with pytest.raises(ContractError, match="int64"):
        alloc.free(torch.tensor([0], dtype=torch.int32))
    assert alloc.available() == 4


@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_default_free_refuses_what_it_does_not_own(page_size):
    """Default mode drops pages it does not own instead of corrupting the free list."""
    ps = page_size
    alloc = SlotAllocator(CpuBackend(), 6 * ps, ps)
    a, b = alloc.alloc(2 * ps), alloc.alloc(ps)
    state = free_list(alloc)
    # The sentinel, out of range, never handed out, and (pages of more than one slot) not at a page start.
    bad = [t([-1]), t([6 * ps]), t([-(2**40)]), t([5 * ps])] + ([t([int(b[0]) + 1] * ps)] if ps > 1 else [])
    for locs in bad:
        alloc.free(locs)
    assert free_list(alloc) == state and alloc.available() == 3 * ps
    alloc.free(torch.cat([b, b]))  # the page given twice in one call comes back once
    alloc.free(b)  # and a later double free is refused
    assert free_list(alloc) == state + [int(b[0]) // ps] and alloc.available() == 4 * ps
    # Everything free is handed out exactly once: four pages, then nothing.
    rest = alloc.alloc(4 * ps)
    pages = {loc // ps for loc in rest.tolist()}
    assert len(pages) == 4 and pages.isdisjoint({loc // ps for loc in a.tolist()})
    with pytest.raises(OutOfSlotsError):
        alloc.alloc(1)


def test_default_free_keeps_the_oldest_pages_first():
    """Pages given back wait beside the free list and join it, in order, when an allocation needs them."""
    alloc = SlotAllocator(CpuBackend(), 4)
    alloc.free(alloc.alloc(3))
    assert alloc.available() == 4
    assert alloc.alloc(2).tolist() == [3, 0]
    assert alloc.alloc(2).tolist() == [1, 2]


def test_allocator_rejects_bad_sizes():
    with pytest.raises(ContractError, match="'page_size'"):
        SlotAllocator(CpuBackend(), 16, page_size=0)
    with pytest.raises(ContractError, match="hold no page"):
        SlotAllocator(CpuBackend(), 8, page_size=16)


def test_allocator_never_reads_device_data():
    """Non-strict alloc, alloc_extend and free on the meta device: any data read would raise."""
    backend = CpuBackend()
    backend.device = torch.device("meta")
    alloc = SlotAllocator(backend, 64, page_size=4)

    def m(values):
        return torch.tensor(values, dtype=I64, device="meta")

    a = alloc.alloc(6)
    b = alloc.alloc_extend(m([0, 6]), m([5, 9]), m([-1, 5]), [0, 6], [5, 9])
    assert a.shape == (6,) and b.shape == (8,) and alloc.available() == 64 - 5 * 4
    alloc.free(a)
    assert alloc.available() == 64 - 3 * 4


# ------------------------------------------------------------------ allocator + pool, simulated serving


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(PAGE_SIZES), st.booleans(), st.integers(0, 2**32 - 1))
def test_serving_simulation_keeps_slots_disjoint_and_paged(page_size, strict, seed):
    """Requests arrive, grow and finish at random; every live slot has one owner, pages stay whole."""
    rng = random.Random(seed)
    backend = CpuBackend(strict=strict)
    num_pages, M = 12, 6 * page_size
    alloc = SlotAllocator(backend, num_pages * page_size, page_size)
    pool = ReqToTokenPool(5, M)
    lens: dict[int, int] = {}  # row -> tokens held

    def held_pages():
        return sum(-(-n // page_size) for n in lens.values())

    for _ in range(30):
        action = rng.choice(["new", "grow", "grow", "finish"])
        if action == "new" and pool.available():
            row, n = pool.alloc(), rng.randint(0, 3 * page_size)
            try:
                locs = alloc.alloc_extend(t([0]), t([n]), t([-1]), [0], [n])
            except OutOfSlotsError:
                assert -(-n // page_size) > num_pages - held_pages()
                pool.free(row)
                continue
            backend.assign_req_to_token(pool.req_to_token, t([row]), t([0]), t([n]), locs)
            lens[row] = n
        elif action == "grow" and lens:
            rows = rng.sample(sorted(lens), rng.randint(1, len(lens)))
            old = [lens[r] for r in rows]
            new = [min(M, o + rng.randint(0, 2 * page_size)) for o in old]
            last = [int(pool.req_to_token[r, o - 1]) if o else -1 for r, o in zip(rows, old)]
            before = free_list(alloc)
            try:
                locs = alloc.alloc_extend(t(old), t(new), t(last), old, new)
            except OutOfSlotsError:
                assert sum(-(-n // page_size) - (-(-o // page_size)) for o, n in zip(old, new)) > alloc.free_pages
                assert free_list(alloc) == before
                continue
            backend.assign_req_to_token(pool.req_to_token, t(rows), t(old), t(new), locs)
            lens.update(zip(rows, new))
        elif action == "finish" and lens:
            row = rng.choice(sorted(lens))
            alloc.free(pool.req_to_token[row, :lens.pop(row)].clone())
            pool.free(row)
        assert alloc.available() == (num_pages - held_pages()) * page_size
        owned = []
        for row, n in lens.items():
            locs = pool.req_to_token[row, :n].tolist()
            assert all(loc % page_size == pos % page_size for pos, loc in enumerate(locs))
            assert all(locs[p] // page_size == locs[p - p % page_size] // page_size for p in range(n))
            owned += {loc // page_size for loc in locs}
        assert len(owned) == len(set(owned))
        assert set(owned).isdisjoint(free_list(alloc))
    for row, n in list(lens.items()):
        alloc.free(pool.req_to_token[row, :n].clone())
        pool.free(row)
    assert sorted(free_list(alloc)) == list(range(num_pages)) and pool.available() == 5


# ------------------------------------------------------------------ KVCache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_from_token_budget(dtype):
    kv = KVCache(30, 100, 3, 64, dtype=dtype)
    assert kv.k.shape == kv.v.shape == (30, 101, 3, 64)
    assert kv.k.dtype == dtype and kv.num_slots == 100
    per_slot = KVCache.bytes_per_slot(30, 3, 64, dtype)
    assert per_slot == 2 * 30 * 3 * 64 * (4 if dtype == torch.float32 else 2)
    assert kv.nbytes == per_slot * 101


def test_kv_cache_from_memory_fraction():
    per_slot = KVCache.bytes_per_slot(2, 3, 8, torch.float32)
    kv = KVCache.from_memory_fraction(0.5, 2, 3, 8, torch.float32, "cpu", free_bytes=per_slot * 200)
    assert kv.num_slots == 99  # 100 rows fit: 99 slots plus the scratch row
    assert kv.nbytes <= per_slot * 100
    with pytest.raises(ContractError, match="'fraction'"):
        KVCache.from_memory_fraction(1.5, 2, 3, 8, torch.float32, "cpu", free_bytes=per_slot * 200)
    with pytest.raises(ContractError, match="holds no slot"):
        KVCache.from_memory_fraction(0.01, 2, 3, 8, torch.float32, "cpu", free_bytes=per_slot * 10)
    assert free_device_bytes(torch.device("cpu")) > 0


def test_kv_cache_rejects_bad_arguments():
    with pytest.raises(ContractError, match="'num_slots'"):
        KVCache(2, 0, 3, 8)
    with pytest.raises(ContractError, match="'dtype'"):
        KVCache(2, 4, 3, 8, dtype=torch.int64)

"""The Triton allocation, cache-location and KV kernels against the reference backend.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (``conftest.py``
sets ``TRITON_INTERPRET=1``), which checks their index math. Each op runs through a backend that
mixes :class:`TritonHalOps` into :class:`Backend` under two launch configurations: the default one,
and a tiny one whose blocks and tiles are so small that every loop runs several times (the
running sums over several request blocks, ``move_kv``'s scratch path, several column blocks).

Default-mode robustness: values the contract forbids (only strict mode rejects them) must not
make a kernel touch memory outside the tensors it was given. Tables and caches are views into
larger buffers whose guard rows must stay untouched, and the ops must act as if every
out-of-range index were the -1 sentinel.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from ngram_hal import Backend  # noqa: E402
from ngram_hal.kernels.triton import LaunchConfig  # noqa: E402
from ngram_hal.kernels.triton import kv as triton_kv  # noqa: E402
from ngram_hal.kernels.triton.ops import TritonHalOps  # noqa: E402
from ngram_hal.kv_cache import KVCache  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402
from ngram_hal_conformance import cases  # noqa: E402
from ngram_hal_conformance import test_alloc as alloc_cases  # noqa: E402
from ngram_hal_conformance import test_kv as kv_cases  # noqa: E402
from ngram_hal_conformance.checks import assert_bitwise, assert_equal, assert_index_output, slots  # noqa: E402

I64 = torch.int64
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SETTINGS = settings(max_examples=12, deadline=None)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TINY = LaunchConfig(num_warps=1, index_block=16, kv_segment_bytes=8, move_pair_tile=4, kv_tile_bytes=32,
                    tile_bytes_per_thread=8)
CONFIGS = {"default": LaunchConfig(), "tiny": TINY}
rngs = st.randoms(use_true_random=False)


class TritonBackend(TritonHalOps, Backend):
    """The Triton kernels behind the HAL's checks, on this test session's device."""

    name = "triton-test"


def make_backend(config: str = "default", strict: bool = False) -> TritonBackend:
    backend = TritonBackend(device=DEVICE, strict=strict)
    backend.launch = CONFIGS[config]
    return backend


REFERENCE = CpuBackend(device=DEVICE)
configs = st.sampled_from(sorted(CONFIGS))


def ix(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I64, device=DEVICE)


def guarded_table(values: list[list[int]], guard: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """``(table, buffer)``: ``table`` is a contiguous view of ``buffer`` between ``guard`` rows of
    -7 above and below, so a write outside the table changes ``buffer``'s guard rows."""
    R, M = len(values), len(values[0])
    buffer = torch.full((R + 2 * guard, M), -7, dtype=I64, device=DEVICE)
    table = buffer[guard:guard + R]
    table.copy_(ix(values))
    return table, buffer


def guarded_cache(rng: random.Random, layers: int, num_slots: int, heads: int, head_dim: int,
                  dtype: torch.dtype) -> tuple[KVCache, torch.Tensor, torch.Tensor]:
    """A random cache whose K and V are views between a guard layer above and below; returns the
    cache and the two full buffers."""
    kv = cases.random_kv(rng, DEVICE, layers, num_slots, heads, head_dim, dtype)
    buffers = []
    for name in ("k", "v"):
        buf = torch.randn((layers + 2, num_slots + 1, heads, head_dim), device=DEVICE).to(dtype)
        buf[1:layers + 1] = getattr(kv, name)
        setattr(kv, name, buf[1:layers + 1])
        buffers.append(buf)
    return kv, buffers[0], buffers[1]


def assert_same_guards(before: torch.Tensor, after: torch.Tensor, what: str) -> None:
    assert_bitwise(after[0], before[0], f"{what}: the guard before the tensor")
    assert_bitwise(after[-1], before[-1], f"{what}: the guard after the tensor")


def clone_kv(kv: KVCache) -> KVCache:
    return cases.Call("move_kv", {"kv": kv}).clone().args["kv"]


def assert_same_kv(mine: KVCache, ref: KVCache, what: str) -> None:
    S = ref.num_slots
    assert_bitwise(slots(mine.k, S), slots(ref.k, S), f"{what}: K")
    assert_bitwise(slots(mine.v, S), slots(ref.v, S), f"{what}: V")


# ---------------------------------------------------------------- alloc_extend


@SETTINGS
@given(rng=rngs, config=configs, batch=st.integers(1, 40), page_size=st.sampled_from([1, 2, 4, 16]),
       max_len=st.integers(0, 40), spare=st.integers(0, 3))
def test_alloc_extend_matches_reference(rng, config, batch, page_size, max_len, spare):
    call = alloc_cases.alloc_extend_call(rng, DEVICE, batch, page_size, max_len, spare)
    got = call.run(make_backend(config))
    assert_index_output(got, DEVICE, (call.args["num_new_tokens"],), "alloc_extend")
    assert_equal(got, call.run(REFERENCE), "alloc_extend vs reference")


def test_alloc_extend_long_requests_span_blocks():
    """Requests of thousands of tokens loop over many token blocks inside one program."""
    call = alloc_cases.alloc_extend_call(random.Random(3), DEVICE, 5, 16, 3000, 1)
    for config in CONFIGS:
        assert_equal(call.run(make_backend(config)), call.run(REFERENCE), f"alloc_extend ({config})")


def test_alloc_extend_empty():
    backend = make_backend()
    empty = ix([])
    out = backend.alloc_extend(empty, empty, empty, ix([3, 4]), 4, 0)
    assert_index_output(out, DEVICE, (0,), "alloc_extend of no requests")
    out = backend.alloc_extend(ix([2, 5]), ix([2, 5]), ix([1, 9]), empty, 1, 0)
    assert_index_output(out, DEVICE, (0,), "alloc_extend of no new tokens")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_alloc_extend_robust_to_bad_values(config):
    """Default mode: a short free list, a negative length and a wrong total give -1 entries, never
    a read outside the free list or a write outside the output."""
    backend = make_backend(config)
    prefix, seq, last = ix([0, 3, 9, 2]), ix([5, 1, 14, 6]), ix([-1, 10, 33, 21])
    # Request 1 shrinks (counts as empty). Pages needed: 2 + 0 + 1 + 1 at page size 4, two given.
    got = backend.alloc_extend(prefix, seq, last, ix([7, 8]), 4, 14)
    assert_equal(got, [28, 29, 30, 31, 32, 34, 35, 36, -1, -1, 22, 23, -1, -1], "short free list")
    full = [28, 29, 30, 31, 32, 34, 35, 36, 40, 41, 22, 23, 44, 45]
    pages = ix([7, 8, 10, 11])
    assert_equal(backend.alloc_extend(prefix, seq, last, pages, 4, 14), full, "enough pages")
    assert_equal(backend.alloc_extend(prefix, seq, last, pages, 4, 9), full[:9], "total too small")
    assert_equal(backend.alloc_extend(prefix, seq, last, pages, 4, 17), full + [-1] * 3, "total too large")
    huge = backend.alloc_extend(ix([-5, 2**62]), ix([2**62, -2**62]), ix([-1, 3]), pages, 4, 6)
    assert_index_output(huge, DEVICE, (6,), "alloc_extend of absurd lengths")
    assert_equal(backend.alloc_extend(ix([]), ix([]), ix([]), pages, 4, 3), [-1, -1, -1], "no requests, 3 tokens")


# ---------------------------------------------------------------- assign_req_to_token / gather_cache_locs


@SETTINGS
@given(rng=rngs, config=configs, batch=st.integers(1, 40), extra_rows=st.integers(0, 3),
       max_context=st.integers(1, 40))
def test_assign_req_to_token_matches_reference(rng, config, batch, extra_rows, max_context):
    call = alloc_cases.assign_req_to_token_call(rng, DEVICE, batch, batch + extra_rows, max_context)
    mine, ref = call.clone(), call.clone()
    assert mine.run(make_backend(config)) is None
    ref.run(REFERENCE)
    assert_equal(mine.args["req_to_token"], ref.args["req_to_token"], "req_to_token vs reference")


@SETTINGS
@given(rng=rngs, config=configs, batch=st.integers(1, 40), extra_rows=st.integers(0, 3),
       max_context=st.integers(1, 40))
def test_gather_cache_locs_matches_reference(rng, config, batch, extra_rows, max_context):
    call = alloc_cases.gather_cache_locs_call(rng, DEVICE, batch, batch + extra_rows, max_context)
    got = call.run(make_backend(config))
    assert_index_output(got, DEVICE, (call.args["num_tokens"],), "gather_cache_locs")
    assert_equal(got, call.run(REFERENCE), "gather_cache_locs vs reference")


def test_cache_locs_empty():
    backend = make_backend()
    table = ix([[1, 2, 3], [4, 5, 6]])
    before = table.clone()
    backend.assign_req_to_token(table, ix([]), ix([]), ix([]), ix([]))
    backend.assign_req_to_token(table, ix([1, 0]), ix([2, 1]), ix([2, 1]), ix([]))
    assert_equal(table, before, "req_to_token after assigning nothing")
    assert_index_output(backend.gather_cache_locs(table, ix([]), ix([]), ix([]), 0), DEVICE, (0,), "gather of none")
    assert_index_output(backend.gather_cache_locs(table, ix([0]), ix([1]), ix([1]), 0), DEVICE, (0,),
                        "gather of empty ranges")


def bad_ranges(rng: random.Random, batch: int, rows: int, cols: int):
    """Request rows and ranges with values outside the table: rows < 0 or >= R, negative starts,
    ends past M, end < start. The rows inside the table are distinct."""
    free = rng.sample(range(rows), rows)
    pool = [free.pop() if free and rng.random() < 0.6 else rng.choice([-1, -3, rows, rows + 5]) for _ in range(batch)]
    start = [rng.randint(-4, cols + 2) for _ in range(batch)]
    end = [s + rng.randint(-3, cols + 3) for s in start]
    return pool, start, end


def robust_cells(pool, start, end, rows: int, cols: int, total: int):
    """Default-mode meaning: ``(flat output index, (row, col) or None)`` of every entry, ranges with
    end < start being empty and cells outside the table being None."""
    out, off = [], 0
    for r, s, e in zip(pool, start, end):
        for t in range(max(e - s, 0)):
            if off + t < total:
                inside = 0 <= r < rows and 0 <= s + t < cols
                out.append((off + t, (r, s + t) if inside else None))
        off += max(e - s, 0)
    return out


@SETTINGS
@given(rng=rngs, config=configs, batch=st.integers(1, 20), rows=st.integers(1, 4), cols=st.integers(1, 12),
       slack=st.integers(-3, 3))
def test_cache_locs_robust_to_out_of_range(rng, config, batch, rows, cols, slack):
    """Default mode: cells outside the table gather as -1 and are never written; a wrong
    ``locs`` length or ``num_tokens`` truncates or pads with -1."""
    backend = make_backend(config)
    values = [[rng.randint(-1, 99) for _ in range(cols)] for _ in range(rows)]
    table, buffer = guarded_table(values)
    pool, start, end = bad_ranges(rng, batch, rows, cols)
    total = max(sum(max(e - s, 0) for s, e in zip(start, end)) + slack, 0)
    args = (ix(pool), ix(start), ix(end))

    got = backend.gather_cache_locs(table, *args, total)
    want = [-1] * total
    for at, cell in robust_cells(pool, start, end, rows, cols, total):
        want[at] = values[cell[0]][cell[1]] if cell else -1
    assert_equal(got, want, "gather_cache_locs over out-of-range cells")

    before = buffer.clone()
    locs = [1000 + i for i in range(total)]
    backend.assign_req_to_token(table, *args, ix(locs))
    for at, cell in robust_cells(pool, start, end, rows, cols, total):
        if cell:
            values[cell[0]][cell[1]] = locs[at]
    assert_equal(table, values, "req_to_token after assigning out-of-range cells")
    assert_same_guards(before, buffer, "req_to_token")


# ---------------------------------------------------------------- accepted_kv_moves


@SETTINGS
@given(rng=rngs, config=configs, batch=st.integers(1, 24), depth=st.integers(1, 20), extra_rows=st.integers(0, 3),
       extra_context=st.integers(0, 20), extra_slots=st.integers(0, 16))
def test_accepted_kv_moves_matches_reference(rng, config, batch, depth, extra_rows, extra_context, extra_slots):
    call = kv_cases.accepted_kv_moves_call(rng, DEVICE, batch, depth, batch + extra_rows, depth + extra_context,
                                   batch * depth + extra_slots)
    src, dst = call.run(make_backend(config))
    ref_src, ref_dst = call.run(REFERENCE)
    assert_index_output(src, DEVICE, (batch * depth,), "accepted_kv_moves src")
    assert_index_output(dst, DEVICE, (batch * depth,), "accepted_kv_moves dst")
    assert_equal(src, ref_src, "src vs reference")
    assert_equal(dst, ref_dst, "dst vs reference")


@SETTINGS
@given(rng=rngs, config=configs, batch=st.integers(1, 6), depth=st.integers(1, 6), rows=st.integers(1, 3),
       cols=st.integers(1, 10))
def test_accepted_kv_moves_robust_to_out_of_range(rng, config, batch, depth, rows, cols):
    """Default mode: a node id outside ``[0, B*D)`` ends the accepted run like -1; a table cell
    outside the table gives dst -1."""
    n = batch * depth
    out_cache_loc = [rng.randrange(100) for _ in range(n)]
    accept = [[rng.choice([rng.randrange(n), -1, -9, n, n + 4]) for _ in range(depth)] for _ in range(batch)]
    pool = [rng.choice([rng.randrange(rows), -2, rows]) for _ in range(batch)]
    seq = [rng.randint(-3, cols + 2) for _ in range(batch)]
    values = [[rng.randrange(100) for _ in range(cols)] for _ in range(rows)]
    table, _ = guarded_table(values)
    src, dst = make_backend(config).accepted_kv_moves(ix(out_cache_loc), ix(accept), table, ix(pool), ix(seq))
    want_src, want_dst = [-1] * n, [-1] * n
    for b in range(batch):
        for j, node in enumerate(accept[b]):
            if not 0 <= node < n:
                break
            want_src[b * depth + j] = out_cache_loc[node]
            r, col = pool[b], seq[b] + j
            want_dst[b * depth + j] = values[r][col] if 0 <= r < rows and 0 <= col < cols else -1
    assert_equal(src, want_src, "src")
    assert_equal(dst, want_dst, "dst")


def test_accepted_kv_moves_empty():
    src, dst = make_backend().accepted_kv_moves(ix([]), torch.empty((0, 4), dtype=I64, device=DEVICE),
                                                ix([[1, 2]]), ix([]), ix([]))
    assert_index_output(src, DEVICE, (0,), "src")
    assert_index_output(dst, DEVICE, (0,), "dst")


# ---------------------------------------------------------------- store_kv


@SETTINGS
@given(rng=rngs, config=configs, dtype=st.sampled_from(DTYPES), layers=st.integers(1, 3),
       num_slots=st.integers(1, 40), heads=st.integers(1, 3), head_dim=st.sampled_from([1, 4, 8, 12]),
       holes=st.integers(0, 3), data=st.data())
def test_store_kv_matches_reference(rng, config, dtype, layers, num_slots, heads, head_dim, holes, data):
    n = data.draw(st.integers(0, num_slots), label="n")
    kv = cases.random_kv(rng, DEVICE, layers, num_slots, heads, head_dim, dtype)
    call = kv_cases.store_kv_call(rng, DEVICE, kv, n, holes)
    mine, ref = call.clone(), call.clone()
    mine.run(make_backend(config))
    ref.run(REFERENCE)
    assert_same_kv(mine.args["kv"], ref.args["kv"], "store_kv")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_store_kv_robust_to_out_of_range(dtype):
    """Default mode: locs outside ``[0, S)`` write nothing, not even the scratch row or a
    neighbouring layer."""
    kv, kbuf, vbuf = guarded_cache(random.Random(0), 2, 6, 2, 4, dtype)
    before_k, before_v = kbuf.clone(), vbuf.clone()
    locs = [6, 4, -2, 7, 2**40, -2**40, 0, 13]
    k = cases.random_rows(random.Random(1), DEVICE, len(locs), 2, 4, dtype)
    v = cases.random_rows(random.Random(2), DEVICE, len(locs), 2, 4, dtype)
    for layer in (0, 1):
        make_backend().store_kv(kv, layer, ix(locs), k, v)
        before_k[1 + layer, 4], before_k[1 + layer, 0] = k[1], k[6]
        before_v[1 + layer, 4], before_v[1 + layer, 0] = v[1], v[6]
    assert_bitwise(kbuf, before_k, "K buffer")
    assert_bitwise(vbuf, before_v, "V buffer")


# ---------------------------------------------------------------- move_kv


def fan_out(rng: random.Random, num_slots: int, n: int) -> tuple[list[int], list[int]]:
    """A few sources each copied to several destinations, sources among the destinations."""
    dst = rng.sample(range(num_slots), n)
    sources = rng.sample(range(num_slots), max(1, n // 4))
    return [rng.choice(sources) for _ in range(n)], dst


def mixed(rng: random.Random, num_slots: int, n: int) -> tuple[list[int], list[int]]:
    """A random move set with -1 pairs, src == dst pairs and a dead pair sharing a live dst."""
    dst = rng.sample(range(num_slots), n)
    src = [rng.randrange(num_slots) for _ in range(n)]
    for i in range(n):
        roll = rng.random()
        if roll < 0.15:
            src[i] = -1
        elif roll < 0.3:
            dst[i] = -1
        elif roll < 0.45:
            src[i] = dst[i]
    return src + [-1], dst + [dst[0]]


def move_set(pattern: str, rng: random.Random, num_slots: int, n: int) -> tuple[list[int], list[int]]:
    if pattern == "fan_out":
        return fan_out(rng, num_slots, n)
    if pattern == "mixed":
        return mixed(rng, num_slots, n)
    call = kv_cases.move_kv_call(rng, DEVICE, KVCache(1, num_slots, 1, 1), n, pattern)
    return call.args["src"].tolist(), call.args["dst"].tolist()


MOVE_PATTERNS = (*kv_cases.MOVE_PATTERNS, "fan_out", "mixed")


@SETTINGS
@given(rng=rngs, config=configs, pattern=st.sampled_from(MOVE_PATTERNS), dtype=st.sampled_from(DTYPES),
       layers=st.integers(1, 3), heads=st.integers(1, 3), head_dim=st.sampled_from([1, 4, 6]),
       num_slots=st.integers(2, 48), data=st.data())
def test_move_kv_matches_reference(rng, config, pattern, dtype, layers, heads, head_dim, num_slots, data):
    """Every pattern, through registers (default tile) and through the scratch buffer (tiny tile)."""
    n = data.draw(st.integers(1, num_slots - 1 if pattern == "chain" else num_slots), label="n")
    src, dst = move_set(pattern, rng, num_slots, n)
    kv = cases.random_kv(rng, DEVICE, layers, num_slots, heads, head_dim, dtype)
    mine, ref = clone_kv(kv), clone_kv(kv)
    make_backend(config).move_kv(mine, ix(src), ix(dst))
    REFERENCE.move_kv(ref, ix(src), ix(dst))
    assert_same_kv(mine, ref, f"move_kv {pattern}")


@pytest.mark.parametrize("tile", [16, 64, 256])
@pytest.mark.parametrize("pattern", MOVE_PATTERNS)
def test_move_kv_many_pairs_through_scratch(pattern, tile):
    """Hundreds of overlapping pairs with a pair tile of 16 to 256: several tiles each way."""
    rng = random.Random(f"{pattern}{tile}")
    num_slots = 600
    src, dst = move_set(pattern, rng, num_slots, 500)
    kv = cases.random_kv(rng, DEVICE, 2, num_slots, 2, 8, torch.bfloat16)
    mine, ref = clone_kv(kv), clone_kv(kv)
    backend = make_backend()
    backend.launch = dataclasses.replace(LaunchConfig(), move_pair_tile=tile)
    backend.move_kv(mine, ix(src), ix(dst))
    REFERENCE.move_kv(ref, ix(src), ix(dst))
    assert_same_kv(mine, ref, f"move_kv {pattern} with tile {tile}")


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_move_kv_fixed_sets(config):
    """Swap, 3-cycle, chains both ways, fan-out and tree compaction, bit-exact."""
    sets = {"swap": ([3, 7], [7, 3]), "cycle3": ([1, 2, 3], [2, 3, 1]),
            "chain_forward": ([0, 1, 2, 3], [1, 2, 3, 4]), "chain_backward": ([3, 2, 1, 0], [4, 3, 2, 1]),
            "fan_out": ([5, 5, 5], [5, 6, 7]), "tree_compaction": ([9, 11, 14], [8, 9, 10])}
    for name, (src, dst) in sets.items():
        kv = cases.random_kv(random.Random(name), DEVICE, 2, 16, 2, 4, torch.float32)
        mine, ref = clone_kv(kv), clone_kv(kv)
        make_backend(config).move_kv(mine, ix(src), ix(dst))
        REFERENCE.move_kv(ref, ix(src), ix(dst))
        assert_same_kv(mine, ref, name)


def test_move_kv_empty():
    kv = cases.random_kv(random.Random(0), DEVICE, 1, 4, 1, 2, torch.float16)
    before = clone_kv(kv)
    make_backend().move_kv(kv, ix([]), ix([]))
    assert_same_kv(kv, before, "move_kv of no pairs")


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_move_kv_robust_to_out_of_range(config, dtype):
    """Default mode: a pair with a side outside ``[0, S)`` does nothing and touches nothing
    outside the cache; the other pairs move as if those were -1 pairs."""
    S = 10
    src = [2, 12, 3, -5, 2**40, 9, 10, 4]
    dst = [5, 1, 10, 6, 7, -2**40, 8, 2]
    as_sentinel = [(s if 0 <= s < S else -1, d if 0 <= d < S else -1) for s, d in zip(src, dst)]
    kv, kbuf, vbuf = guarded_cache(random.Random(dtype.itemsize), 2, S, 2, 4, dtype)
    ref = clone_kv(kv)
    before_k, before_v = kbuf.clone(), vbuf.clone()
    make_backend(config).move_kv(kv, ix(src), ix(dst))
    REFERENCE.move_kv(ref, ix([s for s, _ in as_sentinel]), ix([d for _, d in as_sentinel]))
    assert_same_kv(kv, ref, "move_kv with out-of-range pairs")
    assert_same_guards(before_k, kbuf, "K")
    assert_same_guards(before_v, vbuf, "V")
    assert_bitwise(kv.k[:, S], before_k[1:-1, S], "K scratch row")


@pytest.mark.parametrize("n", [3, 40])
def test_move_kv_is_one_launch(monkeypatch, n):
    """All layers, K and V, in one launch, in registers and through the scratch buffer."""
    launches = []
    kernel = triton_kv.move_kv_kernel
    real = kernel.run

    def counted(*args, **kwargs):
        launches.append(kwargs["grid"])
        return real(*args, **kwargs)

    monkeypatch.setattr(kernel, "run", counted)
    kv = cases.random_kv(random.Random(n), DEVICE, 4, 48, 2, 4, torch.float32)
    ref = clone_kv(kv)
    src, dst = move_set("cycle", random.Random(n), 48, n)
    backend = make_backend()
    backend.launch = dataclasses.replace(LaunchConfig(), move_pair_tile=16)
    backend.move_kv(kv, ix(src), ix(dst))
    REFERENCE.move_kv(ref, ix(src), ix(dst))
    assert len(launches) == 1, f"{len(launches)} launches"
    assert_same_kv(kv, ref, "move_kv")


def test_kv_kernels_need_contiguous_cache():
    kv = cases.random_kv(random.Random(0), DEVICE, 2, 4, 2, 4, torch.float32)
    kv.k = kv.k.transpose(2, 3)
    with pytest.raises(ValueError, match="contiguous"):
        triton_kv.move_kv(kv, ix([0]), ix([1]), LaunchConfig())


def test_launch_config_rejects_bad_tiles():
    with pytest.raises(ValueError, match="move_pair_tile"):
        LaunchConfig(move_pair_tile=24)
    with pytest.raises(ValueError, match="kv_segment_bytes"):
        LaunchConfig(kv_segment_bytes=0)

"""The reference allocation, cache-location and KV ops against slow, loop-based oracles."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_hal import ContractError
from ngram_hal.kv_cache import KVCache
from ngram_hal.reference import CpuBackend
from ngram_hal.reference import alloc as ref_alloc
from ngram_hal.reference import kv as ref_kv

I64 = torch.int64
SETTINGS = settings(max_examples=40, deadline=None)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I64)


@pytest.fixture(params=[False, True], ids=["default", "strict"])
def backend(request) -> CpuBackend:
    return CpuBackend(strict=request.param)


def filled_cache(L=3, S=10, H=2, d=4, dtype=torch.float32, seed=0) -> KVCache:
    kv = KVCache(L, S, H, d, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    kv.k.copy_(torch.randn(kv.k.shape, generator=g).to(dtype))
    kv.v.copy_(torch.randn(kv.v.shape, generator=g).to(dtype))
    return kv


# ------------------------------------------------------------------ oracles


def oracle_alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size):
    """Walk each request's new positions: a page boundary opens the next free page."""
    out, head = [], 0
    for p, s, prev in zip(prefix_lens, seq_lens, last_loc):
        for pos in range(p, s):
            if pos % page_size == 0:
                slot = free_pages[head] * page_size
                head += 1
            else:
                slot = prev + 1
            out.append(slot)
            prev = slot
    return out


def oracle_assign(table, rows, start, end, locs):
    table = [list(r) for r in table]
    i = 0
    for r, s, e in zip(rows, start, end):
        for pos in range(s, e):
            table[r][pos] = locs[i]
            i += 1
    return table


def oracle_gather(table, rows, start, end):
    return [table[r][pos] for r, s, e in zip(rows, start, end) for pos in range(s, e)]


def oracle_move(cache: torch.Tensor, src, dst) -> torch.Tensor:
    before = cache.clone()
    after = cache.clone()
    for s, d in zip(src, dst):
        if s != -1 and d != -1:
            after[:, d] = before[:, s]
    return after


def oracle_accepted(out_cache_loc, accept_index, table, rows, seq_lens):
    B, D = len(accept_index), len(accept_index[0])
    src, dst = [-1] * (B * D), [-1] * (B * D)
    for b in range(B):
        for j in range(D):
            node = accept_index[b][j]
            if node == -1:
                break
            src[b * D + j] = out_cache_loc[node]
            dst[b * D + j] = table[rows[b]][seq_lens[b] + j]
    return src, dst


# ------------------------------------------------------------------ alloc_extend


@st.composite
def extend_case(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    B = draw(st.integers(0, 6))
    prefix = draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    extend = draw(st.lists(st.integers(0, 40), min_size=B, max_size=B))
    seq = [p + e for p, e in zip(prefix, extend)]
    needed = sum(-(-s // page_size) - (-(-p // page_size)) for p, s in zip(prefix, seq))
    spare = draw(st.integers(0, 5))
    perm = draw(st.permutations(range(B + needed + spare)))
    # The first B pages hold each request's last prefix page; the rest form the free list.
    last_loc = [perm[b] * page_size + (p - 1) % page_size if p > 0 else -1 for b, p in enumerate(prefix)]
    free_pages = list(perm[B:])
    return page_size, prefix, seq, last_loc, free_pages


@SETTINGS
@given(extend_case(), st.booleans())
def test_alloc_extend_matches_oracle(case, strict):
    page_size, prefix, seq, last_loc, free_pages = case
    backend = CpuBackend(strict=strict)
    n = sum(s - p for p, s in zip(prefix, seq))
    got = backend.alloc_extend(t(prefix), t(seq), t(last_loc), t(free_pages), page_size, n)
    assert got.dtype == I64 and got.is_contiguous() and got.shape == (n,)
    assert got.tolist() == oracle_alloc_extend(prefix, seq, last_loc, free_pages, page_size)
    assert len(set(got.tolist())) == n


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_alloc_extend_fills_partial_page_then_whole_pages(page_size):
    ps = page_size
    # Request 0 is new (5 tokens), request 1 has 6 tokens in page 9 and grows by 2*ps + 1.
    prefix, seq = [0, 6], [5, 6 + 2 * ps + 1]
    last_loc = [-1, 9 * ps + 5 % ps]
    free_pages = [3, 7, 11, 2, 8, 5, 4, 6, 0, 1, 10, 12]
    got = CpuBackend().alloc_extend(t(prefix), t(seq), t(last_loc), t(free_pages), ps, 5 + 2 * ps + 1).tolist()
    assert got == oracle_alloc_extend(prefix, seq, last_loc, free_pages, ps)
    r1 = got[5:]
    in_partial = (-6) % ps
    assert r1[:in_partial] == [last_loc[1] + 1 + i for i in range(in_partial)]
    for pos, slot in zip(range(6, seq[1]), r1):
        assert slot % ps == pos % ps


def test_alloc_extend_without_free_pages_stays_in_partial_page():
    got = CpuBackend().alloc_extend(t([3]), t([4]), t([2 * 4 + 2]), t([]), 4, 1)
    assert got.tolist() == [11]


# ------------------------------------------------------------------ assign / gather


@st.composite
def rows_case(draw):
    R, M = draw(st.integers(1, 6)), draw(st.integers(1, 24))
    B = draw(st.integers(0, R))
    rows = draw(st.permutations(range(R)))[:B]
    start, end = [], []
    for _ in range(B):
        a, b = sorted(draw(st.lists(st.integers(0, M), min_size=2, max_size=2)))
        start.append(a)
        end.append(b)
    n = sum(e - s for s, e in zip(start, end))
    locs = draw(st.lists(st.integers(-1, 500), min_size=n, max_size=n))
    table = draw(st.lists(st.lists(st.integers(-1, 500), min_size=M, max_size=M), min_size=R, max_size=R))
    return table, rows, start, end, locs


@SETTINGS
@given(rows_case(), st.booleans())
def test_assign_and_gather_match_oracle(case, strict):
    table, rows, start, end, locs = case
    backend = CpuBackend(strict=strict)
    req_to_token = t(table)
    backend.assign_req_to_token(req_to_token, t(rows), t(start), t(end), t(locs))
    assert req_to_token.tolist() == oracle_assign(table, rows, start, end, locs)
    got = backend.gather_cache_locs(req_to_token, t(rows), t(start), t(end), len(locs))
    assert got.dtype == I64 and got.shape == (len(locs),)
    assert got.tolist() == locs
    assert got.tolist() == oracle_gather(req_to_token.tolist(), rows, start, end)


def test_gather_counts_tokens_when_not_given(backend):
    table = t([[5, 6, 7, 8], [1, 2, 3, 4]])
    got = backend.gather_cache_locs(table, t([1, 0]), t([1, 0]), t([3, 2]))
    assert got.tolist() == [2, 3, 5, 6]


def test_assign_int32_locs_raises_and_leaves_table(backend):
    table = torch.full((2, 4), -1, dtype=I64)
    with pytest.raises(ContractError, match="assign_req_to_token.*'locs'.*int64"):
        backend.assign_req_to_token(table, t([0]), t([0]), t([2]), torch.tensor([1, 2], dtype=torch.int32))
    assert bool((table == -1).all())


# ------------------------------------------------------------------ store_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_writes_rows_and_skips_sentinel(backend, dtype):
    kv = filled_cache(dtype=dtype)
    before_k, before_v = kv.k.clone(), kv.v.clone()
    locs = [4, -1, 0, 9, -1]
    k = torch.randn(5, kv.num_heads, kv.head_dim).to(dtype)
    v = torch.randn(5, kv.num_heads, kv.head_dim).to(dtype)
    backend.store_kv(kv, 1, t(locs), k, v)
    want_k, want_v = before_k.clone(), before_v.clone()
    for i, loc in enumerate(locs):
        if loc != -1:
            want_k[1, loc], want_v[1, loc] = k[i], v[i]
    S = kv.num_slots
    assert torch.equal(kv.k[:, :S], want_k[:, :S]) and torch.equal(kv.v[:, :S], want_v[:, :S])


def test_store_kv_bad_input_leaves_cache(backend):
    kv = filled_cache()
    before = kv.k.clone()
    k = torch.randn(2, kv.num_heads, kv.head_dim)
    with pytest.raises(ContractError, match="store_kv.*'locs'"):
        backend.store_kv(kv, 0, torch.tensor([1, 2], dtype=torch.int32), k, k)
    with pytest.raises(ContractError, match="store_kv.*'k'"):
        backend.store_kv(kv, 0, t([1, 2]), k.double(), k)
    assert torch.equal(kv.k, before)


def test_store_kv_strict_rejects_out_of_range_and_duplicates():
    backend = CpuBackend(strict=True)
    kv = filled_cache()
    k = torch.randn(2, kv.num_heads, kv.head_dim)
    before = kv.k.clone()
    with pytest.raises(ContractError, match="'locs'"):
        backend.store_kv(kv, 0, t([1, kv.num_slots]), k, k)
    with pytest.raises(ContractError, match="distinct"):
        backend.store_kv(kv, 0, t([3, 3]), k, k)
    assert torch.equal(kv.k, before)


# ------------------------------------------------------------------ move_kv


def check_move(backend, src, dst, dtype=torch.float32, S=10):
    kv = filled_cache(S=S, dtype=dtype)
    want_k, want_v = oracle_move(kv.k, src, dst), oracle_move(kv.v, src, dst)
    backend.move_kv(kv, t(src), t(dst))
    assert torch.equal(kv.k[:, :S], want_k[:, :S])
    assert torch.equal(kv.v[:, :S], want_v[:, :S])
    return kv


@pytest.mark.parametrize("src,dst", [
    ([0, 1, 2], [1, 2, 0]),                 # 3-cycle a->b, b->c, c->a
    ([1, 0], [0, 1]),                       # swap
    ([0, 1, 2, 3], [1, 2, 3, 4]),           # chain: each dst is the next pair's src
    ([4, 3, 2, 1], [5, 4, 3, 2]),           # chain written in the other order
    ([5, -1, 7, 2, -1], [6, 3, -1, 2, -1]),  # sentinels and src == dst
    ([7, 7, 7], [0, 1, 2]),                 # one source copied to many
    ([], []),
], ids=["cycle", "swap", "chain", "chain-rev", "sentinel-self", "fan-out", "empty"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_move_kv_is_overlap_safe(backend, src, dst, dtype):
    check_move(backend, src, dst, dtype)


def test_move_kv_cycle_rotates_rows():
    kv = filled_cache()
    rows = [kv.k[:, i].clone() for i in range(3)]
    CpuBackend().move_kv(kv, t([0, 1, 2]), t([1, 2, 0]))
    assert torch.equal(kv.k[:, 1], rows[0]) and torch.equal(kv.k[:, 2], rows[1]) and torch.equal(kv.k[:, 0], rows[2])


@st.composite
def move_case(draw):
    S = draw(st.integers(1, 12))
    n = draw(st.integers(0, S))
    dst = list(draw(st.permutations(range(S)))[:n])
    src = [draw(st.integers(0, S - 1)) for _ in range(n)]
    for i in range(n):
        kind = draw(st.sampled_from(["live", "live", "src-1", "dst-1", "both-1", "self"]))
        if kind == "src-1":
            src[i] = -1
        elif kind == "dst-1":
            dst[i] = -1
        elif kind == "both-1":
            src[i] = dst[i] = -1
        elif kind == "self":
            src[i] = dst[i]
    # A pair whose source is -1 may name any destination, even one a live pair writes.
    extra = draw(st.lists(st.integers(0, S - 1), max_size=3))
    return S, src + [-1] * len(extra), dst + extra


@SETTINGS
@given(move_case(), st.booleans())
def test_move_kv_matches_oracle(case, strict):
    S, src, dst = case
    check_move(CpuBackend(strict=strict), src, dst, S=S)


def test_move_kv_strict_rejects_duplicate_dst_and_leaves_cache():
    kv = filled_cache()
    before = kv.k.clone()
    with pytest.raises(ContractError, match="move_kv.*'dst'.*distinct"):
        CpuBackend(strict=True).move_kv(kv, t([0, 1]), t([2, 2]))
    with pytest.raises(ContractError, match="move_kv.*'src'"):
        CpuBackend(strict=True).move_kv(kv, t([0, kv.num_slots]), t([2, 3]))
    assert torch.equal(kv.k, before)


# ------------------------------------------------------------------ accepted_kv_moves


@st.composite
def accept_case(draw):
    B, D = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    R = B + draw(st.integers(0, 2))
    M = D + draw(st.integers(0, 10))
    rows = list(draw(st.permutations(range(R)))[:B])
    seq_lens = [draw(st.integers(0, M - D)) for _ in range(B)]
    accept = []
    for b in range(B):
        n = draw(st.integers(1, D))
        nodes = [0] + sorted(draw(st.lists(st.integers(1, D - 1), unique=True, min_size=n - 1, max_size=n - 1))) \
            if D > 1 else [0]
        row = [b * D + i for i in nodes] + [-1] * (D - len(nodes))
        if len(nodes) < D - 1 and draw(st.booleans()):
            row[-1] = b * D  # an entry after the first -1 is not accepted
        accept.append(row)
    out_cache_loc = draw(st.lists(st.integers(0, 999), min_size=B * D, max_size=B * D))
    table = draw(st.lists(st.lists(st.integers(-1, 999), min_size=M, max_size=M), min_size=R, max_size=R))
    return out_cache_loc, accept, table, rows, seq_lens


@SETTINGS
@given(accept_case(), st.booleans())
def test_accepted_kv_moves_matches_oracle(case, strict):
    out_cache_loc, accept, table, rows, seq_lens = case
    src, dst = CpuBackend(strict=strict).accepted_kv_moves(t(out_cache_loc), t(accept), t(table), t(rows), t(seq_lens))
    B, D = len(accept), len(accept[0])
    for x in (src, dst):
        assert x.dtype == I64 and x.shape == (B * D,) and x.is_contiguous()
    want_src, want_dst = oracle_accepted(out_cache_loc, accept, table, rows, seq_lens)
    assert src.tolist() == want_src and dst.tolist() == want_dst


def test_accepted_moves_compact_tree_nodes_end_to_end(backend):
    """Accepted nodes 0, 2, 5 of a 6-node tree end up at positions seq_len, seq_len+1, seq_len+2."""
    D, seq_len = 6, 3
    table = torch.full((1, 16), -1, dtype=I64)
    nodes = t([10, 4, 11, 2, 12, 13])  # node i's slot, written at positions seq_len + i
    table[0, seq_len:seq_len + D] = nodes
    kv = filled_cache(S=16)
    node_rows = kv.k[:, nodes].clone()
    src, dst = backend.accepted_kv_moves(nodes, t([[0, 2, 5, -1, -1, -1]]), table, t([0]), t([seq_len]))
    backend.move_kv(kv, src, dst)
    for j, node in enumerate([0, 2, 5]):
        assert torch.equal(kv.k[:, int(table[0, seq_len + j])], node_rows[:, node])


# ------------------------------------------------------------------ no host sync


def test_ops_never_read_device_data():
    """On the meta device any read of tensor data raises, so these runs prove there is no host sync."""
    meta = torch.device("meta")

    def m(values):
        return torch.tensor(values, dtype=I64, device=meta)

    locs = ref_alloc.alloc_extend(m([0, 6, 3]), m([5, 9, 3]), m([-1, 5, 2]), m([7, 3, 9, 2]), 4, 8)
    assert locs.shape == (8,) and locs.dtype == I64
    table = torch.full((4, 16), -1, dtype=I64, device=meta)
    ref_alloc.assign_req_to_token(table, m([0, 2]), m([0, 3]), m([2, 5]), m([1, 2, 3, 4]))
    assert ref_alloc.gather_cache_locs(table, m([0, 2]), m([0, 3]), m([2, 5]), 4).shape == (4,)
    kv = KVCache(2, 10, 3, 4, device=meta)
    rows = torch.zeros(2, 3, 4, device=meta)
    ref_kv.store_kv(kv, 1, m([1, -1]), rows, rows)
    ref_kv.move_kv(kv, m([1, 2, -1]), m([2, 1, 3]))
    src, dst = ref_kv.accepted_kv_moves(m(list(range(8))), m([[0, 1, -1, -1], [4, 6, 7, -1]]), table,
                                        m([0, 2]), m([1, 3]))
    assert src.shape == dst.shape == (8,) and src.dtype == dst.dtype == I64

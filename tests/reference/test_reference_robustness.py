"""Default mode on values the contract forbids: the reference ops mask them as a kernel would.

Strict mode rejects these values with a ContractError; default mode does not read the data, so
each op must still stay inside its tensors, never stop half-way through an in-place write, and
leave every entry it was not given a valid reason to change untouched. The oracles below apply
only the in-range part of each call.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_hal.kv_cache import KVCache
from ngram_hal.reference import CpuBackend
from ngram_hal.reference import tree as ref_tree
from ngram_hal.reference import verify as ref_verify

I64 = torch.int64
SETTINGS = settings(max_examples=60, deadline=None)
ANY = st.integers(-(2**40), 2**40)
SMALL = st.integers(-6, 30)


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=I64)


def runs(lengths: list[int], total: int) -> list[list[int]]:
    """Item indices of each run once negative runs are empty and items stop at ``total``."""
    out, i = [], 0
    for n in lengths:
        take = max(0, min(n, total - i))
        out.append(list(range(i, i + take)))
        i += take
    return out


# ------------------------------------------------------------------ cache locations


@st.composite
def garbage_rows(draw):
    R, M = draw(st.integers(1, 4)), draw(st.integers(1, 8))
    B = draw(st.integers(0, 5))
    valid_rows = draw(st.permutations(range(R)))
    rows = [valid_rows[b] if b < R and draw(st.booleans()) else draw(st.sampled_from([-1, R, R + 7, -(2**40)]))
            for b in range(B)]
    start = draw(st.lists(SMALL, min_size=B, max_size=B))
    end = draw(st.lists(SMALL, min_size=B, max_size=B))
    n = draw(st.integers(0, 20))
    locs = draw(st.lists(ANY, min_size=n, max_size=n))
    table = draw(st.lists(st.lists(st.integers(-1, 99), min_size=M, max_size=M), min_size=R, max_size=R))
    return table, rows, start, end, locs


@SETTINGS
@given(garbage_rows())
def test_assign_and_gather_mask_out_of_range_cells(case):
    table, rows, start, end, locs = case
    R, M = len(table), len(table[0])
    want, gathered = [list(r) for r in table], []
    for r, s, items in zip(rows, start, runs([e - s for s, e in zip(start, end)], len(locs))):
        for k, i in enumerate(items):
            inside = 0 <= r < R and 0 <= s + k < M
            if inside:
                want[r][s + k] = locs[i]
            gathered.append((r, s + k) if inside else None)
    req_to_token = t(table)
    CpuBackend().assign_req_to_token(req_to_token, t(rows), t(start), t(end), t(locs))
    assert req_to_token.tolist() == want
    got = CpuBackend().gather_cache_locs(req_to_token, t(rows), t(start), t(end), len(locs)).tolist()
    expect = [want[c[0]][c[1]] if c else -1 for c in gathered]
    assert got == expect + [-1] * (len(locs) - len(expect))


@SETTINGS
@given(st.lists(st.tuples(SMALL, SMALL, st.integers(-3, 40)), max_size=5), st.integers(0, 40),
       st.lists(st.integers(-2, 12), max_size=12), st.sampled_from([1, 4]))
def test_alloc_extend_never_reads_past_the_free_list(reqs, total, free_pages, page_size):
    prefix, seq, last = (list(x) for x in zip(*reqs)) if reqs else ([], [], [])
    got = CpuBackend().alloc_extend(t(prefix), t(seq), t(last), t(free_pages), page_size, total)
    assert got.shape == (total,) and got.dtype == I64
    slots = {p * page_size + o for p in free_pages if p >= 0 for o in range(page_size)}
    slots |= {loc + 1 + k for loc in last if loc >= 0 for k in range(page_size)}
    assert all(s == -1 or s in slots for s in got.tolist())


def test_alloc_extend_marks_positions_without_a_page():
    # Two requests need 3 + 2 pages of one slot; only 4 are free, and the count asks for 6.
    got = CpuBackend().alloc_extend(t([0, 0]), t([3, 2]), t([-1, -1]), t([7, 8, 9, 10]), 1, 6)
    assert got.tolist() == [7, 8, 9, 10, -1, -1]
    # A negative run is empty; the next request starts at once.
    assert CpuBackend().alloc_extend(t([5, 0]), t([2, 2]), t([4, -1]), t([3, 4]), 1, 2).tolist() == [3, 4]


# ------------------------------------------------------------------ KV


def filled_cache(S=6) -> KVCache:
    kv = KVCache(2, S, 1, 2)
    kv.k.copy_(torch.arange(kv.k.numel(), dtype=torch.float32).view(kv.k.shape))
    kv.v.copy_(-kv.k)
    return kv


@SETTINGS
@given(st.lists(st.integers(-3, 9), unique=True, max_size=8))
def test_store_kv_skips_slots_outside_the_cache(locs):
    kv = filled_cache()
    S = kv.num_slots
    want_k, want_v = kv.k.clone(), kv.v.clone()
    k, v = torch.randn(len(locs), 1, 2), torch.randn(len(locs), 1, 2)
    for i, loc in enumerate(locs):
        if 0 <= loc < S:
            want_k[1, loc], want_v[1, loc] = k[i], v[i]
    CpuBackend().store_kv(kv, 1, t(locs), k, v)
    assert torch.equal(kv.k[:, :S], want_k[:, :S]) and torch.equal(kv.v[:, :S], want_v[:, :S])


@SETTINGS
@given(st.permutations(range(6)), st.data())
def test_move_kv_skips_pairs_outside_the_cache(dst_order, data):
    kv = filled_cache(S=6)
    S = kv.num_slots
    src = data.draw(st.lists(st.integers(-3, 9), min_size=S, max_size=S))
    dst = [d if data.draw(st.booleans()) else data.draw(st.sampled_from([-3, -1, S, S + 4])) for d in dst_order]
    before = kv.k.clone()
    want = before.clone()
    for s_, d in zip(src, dst):
        if 0 <= s_ < S and 0 <= d < S:
            want[:, d] = before[:, s_]
    CpuBackend().move_kv(kv, t(src), t(dst))
    assert torch.equal(kv.k[:, :S], want[:, :S])


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 4), st.data())
def test_accepted_kv_moves_drop_out_of_range_entries(B, D, data):
    R, M = 2, 6
    accept = data.draw(st.lists(st.lists(st.integers(-2, B * D + 2), min_size=D, max_size=D), min_size=B, max_size=B))
    rows = data.draw(st.lists(st.integers(-1, R), min_size=B, max_size=B))
    seq_lens = data.draw(st.lists(st.integers(-2, M + 1), min_size=B, max_size=B))
    out_cache_loc = list(range(100, 100 + B * D))
    table = [[10 * r + c for c in range(M)] for r in range(R)]
    want_src, want_dst = [-1] * (B * D), [-1] * (B * D)
    for b in range(B):
        for j in range(D):
            node = accept[b][j]
            if node == -1:
                break
            col = seq_lens[b] + j
            if 0 <= node < B * D and 0 <= rows[b] < R and 0 <= col < M:
                want_src[b * D + j], want_dst[b * D + j] = out_cache_loc[node], table[rows[b]][col]
    src, dst = CpuBackend().accepted_kv_moves(t(out_cache_loc), t(accept), t(table), t(rows), t(seq_lens))
    assert (src.tolist(), dst.tolist()) == (want_src, want_dst)


# ------------------------------------------------------------------ attention


@SETTINGS
@given(st.integers(1, 4), st.data())
def test_attention_survives_any_lengths_rows_and_slots(B, data):
    R, M, S = 3, 8, 12
    kv = KVCache(1, S, 1, 4)
    kv.k.normal_()
    kv.v.normal_()
    before = kv.k.clone()
    N = data.draw(st.integers(1, 12))
    q_lens = data.draw(st.lists(st.integers(-20, 12), min_size=B, max_size=B))
    kv_lens = data.draw(st.lists(st.integers(-20, 12), min_size=B, max_size=B))
    rows = data.draw(st.lists(st.integers(-2, R + 1), min_size=B, max_size=B))
    table = data.draw(st.lists(st.lists(st.integers(-3, S + 3), min_size=M, max_size=M), min_size=R, max_size=R))
    max_kv_len = data.draw(st.integers(0, 12))
    out = CpuBackend().attention(torch.randn(N, 2, 4), kv, 0, t(table), t(rows), t(kv_lens), t(q_lens), 0.5,
                                 max_kv_len=max_kv_len)
    assert out.shape == (N, 2, 4)
    assert torch.equal(kv.k, before)


# ------------------------------------------------------------------ tree and verify


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 5), st.data())
def test_tree_and_verify_stay_in_range_for_any_values(B, D, data):
    mask = torch.tensor(data.draw(st.lists(st.booleans(), min_size=B * D * D, max_size=B * D * D))).view(B, D, D)
    seq_lens = t(data.draw(st.lists(st.integers(0, 50), min_size=B, max_size=B)))
    positions, _, next_token, next_sibling = CpuBackend().reconstruct_tree(mask, seq_lens)
    assert bool((positions.view(B, D) >= seq_lens.unsqueeze(1)).all())
    assert bool(((next_token >= -1) & (next_token < D)).all() and ((next_sibling >= -1) & (next_sibling < D)).all())

    def links():
        return t(data.draw(st.lists(st.lists(st.integers(-3, D + 3), min_size=D, max_size=D), min_size=B, max_size=B)))

    V = 6
    candidates = t(data.draw(st.lists(st.lists(st.integers(-2, V + 2), min_size=D, max_size=D), min_size=B, max_size=B)))
    index, nxt, sib = links(), links(), links()
    greedy = CpuBackend().verify_tree_greedy(candidates, index, nxt, sib, candidates.roll(1, 1).contiguous())
    probs = torch.softmax(torch.randn(B, D, V), -1)
    sampled = CpuBackend().verify_tree_sample(candidates, index, nxt, sib, probs, torch.rand(B, D), torch.rand(B))
    for predicts, accept_index, accept_len in (greedy, sampled):
        assert predicts.shape == (B * D,) and accept_index.shape == (B, D)
        assert bool(((accept_len >= 1) & (accept_len <= D)).all())
    # Sampling commits only candidates inside the vocabulary and bonus tokens drawn from it.
    assert bool(((sampled[0] >= 0) & (sampled[0] < V)).all())


def test_tree_and_verify_never_read_device_data():
    """On the meta device any read of tensor data raises, so these runs prove there is no host sync."""
    meta = torch.device("meta")
    B, D, V = 2, 4, 8
    mask = torch.empty(B, D, D, dtype=torch.bool, device=meta)
    idx = torch.empty(B, D, dtype=I64, device=meta)
    positions, *_ = ref_tree.reconstruct_tree(mask, torch.empty(B, dtype=I64, device=meta))
    assert positions.shape == (B * D,)
    out = ref_verify.verify_tree_sample(idx, idx, idx, idx, torch.empty(B, D, V, device=meta),
                                        torch.empty(B, D, device=meta), torch.empty(B, device=meta))
    assert out[1].shape == (B, D)
    assert ref_verify.verify_tree_greedy(idx, idx, idx, idx, idx)[2].shape == (B,)


@SETTINGS
@given(st.data())
def test_int64_extremes_neither_overflow_into_a_crash_nor_write_out_of_place(data):
    """Lengths and indices near the int64 limits, where sums and products wrap around."""
    extreme = st.sampled_from([-(2**63), -(2**62), -1, 0, 1, 5, 2**62, 2**63 - 1])
    B, N = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 6))

    def draw(n):
        return t(data.draw(st.lists(extreme, min_size=n, max_size=n)))

    table = t([[10 * r + c for c in range(4)] for r in range(2)])
    before = table.clone()
    backend = CpuBackend()
    assert backend.alloc_extend(draw(B), draw(B), draw(B), t([0, 1]), 1, N).shape == (N,)
    backend.assign_req_to_token(table, draw(B), draw(B), draw(B), t(list(range(100, 100 + N))))
    changed = (table != before).view(-1).nonzero().view(-1).tolist()
    assert all(100 <= int(table.view(-1)[i]) < 100 + N for i in changed)
    assert backend.gather_cache_locs(table, draw(B), draw(B), draw(B), N).shape == (N,)
    kv = filled_cache()
    out = backend.attention(torch.randn(N, 2, 2), kv, 0, table, draw(B), draw(B), draw(B), 0.5, max_kv_len=4)
    assert out.shape == (N, 2, 2)

"""The Ascend backend's own guarantees beyond the conformance suite (which `make test-proxy-npu`
runs in full): int32 index operands never wrap and never reach the caller, tables too large for
int32 indices are refused before anything changes, moves are overlap-safe, and its ops agree
with the reference on larger random batches than the suite draws."""

from __future__ import annotations

import random

import pytest
import torch

from ngram_hal import ContractError
from ngram_hal.kv_cache import KVCache
from ngram_hal.reference import CpuBackend
from ngram_hal_conformance.test_attention import random_parents, tree_mask_of
from ngram_hal_npu import NpuBackend
from ngram_hal_npu.indices import INT32_MAX, narrow, take

I64 = torch.int64


@pytest.fixture(scope="module")
def npu():
    return NpuBackend(device="cpu", strict=False)


def test_narrow_refuses_more_rows_than_int32_addresses():
    index = torch.tensor([0, 5], dtype=I64)
    assert narrow("op", "arg", index, INT32_MAX).dtype == torch.int32
    with pytest.raises(ContractError, match=r"op: argument 'arg': addresses 2147483648 rows"):
        narrow("op", "arg", index, INT32_MAX + 1)


def test_out_of_range_index_fails_instead_of_wrapping():
    values = torch.arange(10, dtype=I64) * 100
    assert take("op", "arg", values, torch.tensor([[3, 1]], dtype=I64)).tolist() == [[300, 100]]
    # 2**32 + 1 would wrap to 1 in int32: it must be rejected, not read row 1.
    for bad in (2**32 + 1, 10, -2):
        with pytest.raises((IndexError, RuntimeError)):
            take("op", "arg", values, torch.tensor([bad], dtype=I64))


def test_tables_too_large_for_int32_are_refused_before_any_change():
    """On the meta device (shapes, no data) a cache or table beyond int32 rows costs nothing:
    the refusal must come from shapes alone."""
    meta = NpuBackend(device="meta", strict=False)
    idx = torch.zeros(2, dtype=I64, device="meta")
    big = KVCache(num_layers=2, num_slots=2**30, num_heads=1, head_dim=1, device="meta")
    with pytest.raises(ContractError, match="move_kv: argument 'kv': addresses"):
        meta.move_kv(big, idx, idx)
    huge = KVCache(num_layers=1, num_slots=2**31, num_heads=1, head_dim=1, device="meta")
    k = torch.zeros(2, 1, 1, device="meta")
    with pytest.raises(ContractError, match="store_kv: argument 'locs': addresses"):
        meta.store_kv(huge, 0, idx, k, k)
    table = torch.zeros(2**16, 2**15 + 1, dtype=I64, device="meta")
    with pytest.raises(ContractError, match="gather_cache_locs: argument 'req_to_token': addresses"):
        meta.gather_cache_locs(table, idx[:1], idx[:1], idx[:1] + 1, num_tokens=1)


def test_out_of_range_slot_never_lands_on_the_row_it_wraps_to(npu):
    kv = KVCache(1, 4, 1, 2)
    kv.k.normal_()
    before = kv.k.clone()
    rows = torch.ones(2, 1, 2)
    locs = torch.tensor([2, 2**32 + 1], dtype=I64)  # int32 would wrap 2**32 + 1 to slot 1
    with pytest.raises((IndexError, RuntimeError)):
        npu.store_kv(kv, 0, locs, rows, rows)
    assert torch.equal(kv.k[0, 1], before[0, 1])
    # Strict mode refuses it by value before anything is written.
    strict = NpuBackend(device="cpu", strict=True)
    kv.k.copy_(before)
    with pytest.raises(ContractError, match="store_kv: argument 'locs'"):
        strict.store_kv(kv, 0, locs, rows, rows)
    assert torch.equal(kv.k, before)


def test_move_kv_cycle_and_overlap(npu):
    kv = KVCache(2, 6, 2, 3)
    kv.k.copy_(torch.arange(kv.k.numel(), dtype=torch.float32).view_as(kv.k))
    kv.v.copy_(-kv.k)
    want_k, want_v = kv.k.clone(), kv.v.clone()
    # A 3-cycle, a chain that overlaps it, a skipped pair, a self move.
    src = torch.tensor([0, 1, 2, 3, -1, 5], dtype=I64)
    dst = torch.tensor([1, 2, 0, 4, 3, 5], dtype=I64)
    for s, d in zip(src.tolist(), dst.tolist()):
        if s != -1 and d != -1:
            want_k[:, d], want_v[:, d] = kv.k[:, s], kv.v[:, s]
    npu.move_kv(kv, src, dst)
    assert torch.equal(kv.k[:, :6], want_k[:, :6]) and torch.equal(kv.v[:, :6], want_v[:, :6])


@pytest.mark.parametrize("D", [1, 2, 9, 33])
def test_tree_and_verify_match_the_reference_on_wide_batches(npu, D):
    rng = random.Random(D)
    B, V = 24, 7
    ref = CpuBackend(strict=False)
    mask = torch.tensor([tree_mask_of(random_parents(rng, D)) for _ in range(B)], dtype=torch.bool)
    seq_lens = torch.randint(0, 50, (B,), dtype=I64)
    got, want = npu.reconstruct_tree(mask, seq_lens), ref.reconstruct_tree(mask, seq_lens)
    for g, w in zip(got, want):
        assert g.dtype == I64 and torch.equal(g, w)
    # A small vocabulary, so that many children match and siblings repeat tokens.
    candidates = torch.randint(0, V, (B, D), dtype=I64)
    predict = torch.randint(0, V, (B, D), dtype=I64)
    for g, w in zip(npu.verify_tree_greedy(candidates, *got[1:], predict),
                    ref.verify_tree_greedy(candidates, *want[1:], predict)):
        assert g.dtype == I64 and torch.equal(g, w)
    # Dyadic probabilities and coins: every comparison is exact in float32 on both sides.
    counts = torch.randint(0, 5, (B, D, V))
    total = 64  # >= 5 * V, so token 0 takes the rest of a power of two
    counts[..., 0] += total - counts.sum(-1)
    probs = counts.float() / total
    coins = torch.randint(0, 16, (B, D)).float() / 16
    final = torch.randint(0, 16, (B,)).float() / 16
    for g, w in zip(npu.verify_tree_sample(candidates, *got[1:], probs, coins, final),
                    ref.verify_tree_sample(candidates, *want[1:], probs, coins, final)):
        assert g.dtype == I64 and torch.equal(g, w)


def test_attention_matches_the_reference_on_a_mixed_batch(npu):
    torch.manual_seed(0)
    ref = CpuBackend(strict=False)
    kv = KVCache(1, 200, 2, 16)
    kv.k.normal_()
    kv.v.normal_()
    kv_lens = torch.tensor([1, 37, 64, 5], dtype=I64)
    q_lens = torch.tensor([1, 37, 1, 3], dtype=I64)
    table = torch.full((6, 70), -1, dtype=I64)
    slots = torch.randperm(200)
    used = 0
    for r, n in zip([4, 0, 2, 5], kv_lens.tolist()):
        table[r, :n] = slots[used:used + n]
        used += n
    pool = torch.tensor([4, 0, 2, 5], dtype=I64)
    q = torch.randn(int(q_lens.sum()), 6, 16)
    args = (q, kv, 0, table, pool, kv_lens, q_lens, 0.25)
    torch.testing.assert_close(npu.attention(*args), ref.attention(*args), atol=1e-5, rtol=1e-5)

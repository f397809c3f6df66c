"""attend: the compiled CPU attention of decode steps, which reads keys where they lie in the cache."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ngram_hal.kernels.cpu.attention import KERNEL_QUERIES, _exp, attend
from ngram_hal.kv_cache import KVCache
from ngram_hal.reference.attention import _sdpa, attention, in_place, layout

S, H, D_HEAD = 257, 3, 64


def _case(G: int, Bq: int, T: int, Hq: int = 9, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(G, Bq, Hq, D_HEAD, generator=gen)
    k = torch.randn(S, H, D_HEAD, generator=gen)
    v = torch.randn(S, H, D_HEAD, generator=gen)
    rows = torch.stack([torch.randperm(S, generator=gen)[:T] for _ in range(G)])
    mask = torch.rand(G, Bq, T, generator=gen) < 0.7
    return q, k, v, rows, mask


def _gathered(q, k, v, rows, mask, scale):
    """torch's masked SDPA over copies of the rows (the reference's path for other blocks)."""
    G, T = rows.shape
    ks = k.index_select(0, rows.reshape(-1)).view(G, T, H, D_HEAD)
    vs = v.index_select(0, rows.reshape(-1)).view(G, T, H, D_HEAD)
    return _sdpa(q, ks, vs, mask, scale)


@pytest.mark.parametrize("G,Bq,T,Hq", [(1, 1, 1, 3), (1, 1, 200, 9), (3, 8, 120, 9), (2, 5, 64, 6), (4, 2, 33, 3)])
def test_matches_torch_over_gathered_keys(threads, G, Bq, T, Hq):
    q, k, v, rows, mask = _case(G, Bq, T, Hq)
    mask[:, :, 0] = True  # every query sees a key: torch's softmax of no key is not defined
    got = attend(q, k, v, rows, mask, 0.125)
    assert got.shape == q.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, _gathered(q, k, v, rows, mask, 0.125), rtol=1e-5, atol=1e-5)


def test_a_query_that_sees_no_key_gives_zeros():
    q, k, v, rows, mask = _case(2, 3, 40)
    mask[1, 2] = False
    got = attend(q, k, v, rows, mask, 0.125)
    assert torch.equal(got[1, 2], torch.zeros_like(got[1, 2]))
    assert torch.isfinite(got).all()


def test_keys_are_read_where_they_lie(threads):
    """Only the rows a query sees are read: the others may hold anything, NaN included."""
    q, k, v, rows, mask = _case(2, 4, 50)
    mask[:, :, 0] = True
    before = attend(q, k, v, rows, mask, 0.1)
    unseen = torch.ones(S, dtype=torch.bool)
    unseen[rows[mask.any(1)]] = False
    k[unseen], v[unseen] = float("nan"), float("inf")
    assert torch.equal(attend(q, k, v, rows, mask, 0.1), before)


def test_a_query_does_not_depend_on_its_call(threads):
    """Each query alone, or with other queries and blocks, on the same threads: the same bits. (One
    build of the kernel runs each query's loops alike whatever the call; the serial and the parallel
    build are compiled apart, and their vectorized dot products may sum in another order.)"""
    q, k, v, rows, mask = _case(3, 6, 90)
    together = attend(q, k, v, rows, mask, 0.125)
    for g in range(3):
        for i in range(6):
            alone = attend(q[g:g + 1, i:i + 1], k, v, rows[g:g + 1], mask[g:g + 1, i:i + 1], 0.125)
            assert torch.equal(alone[0, 0], together[g, i])


def test_decode_through_the_reference_reads_the_table_in_place(threads):
    """The reference's attention of a decode batch (blocks of one query) takes the kernel, and
    gives what torch gives over the gathered keys."""
    kv = KVCache(2, 200, H, D_HEAD)
    gen = torch.Generator().manual_seed(3)
    kv.k.copy_(torch.randn(kv.k.shape, generator=gen))
    kv.v.copy_(torch.randn(kv.v.shape, generator=gen))
    table = torch.randperm(200, generator=gen)[:3 * 60].view(3, 60)
    kv_lens, q_lens = torch.tensor([60, 17, 33]), torch.ones(3, dtype=torch.int64)
    plan = layout(table, torch.tensor([2, 0, 1]), kv_lens, q_lens, None, 3, 60)
    q = torch.randn(3, 9, D_HEAD, generator=gen)
    assert in_place(q.view(3, 1, 9, D_HEAD), kv, plan)
    got = attention(q, kv, 1, plan, 0.125)
    rows = plan.rows(kv.num_slots)
    want = _gathered(q.view(3, 1, 9, D_HEAD), kv.k[1], kv.v[1], rows, plan.blocks.mask, 0.125)
    torch.testing.assert_close(got, want.view(3, 9, D_HEAD), rtol=1e-5, atol=1e-5)


def test_exp_follows_torch_within_two_ulp():
    x = torch.cat([torch.linspace(-87.0, 0.0, 200001), torch.tensor([-0.0, -1e-30, -1e-7, -86.99])])
    got = torch.tensor([_exp(np.float32(v)) for v in x.tolist()])
    want = torch.exp(x.double()).float()
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=2.5e-7, atol=0)
    assert _exp(np.float32(-200.0)) < 1e-37


def test_prefills_and_half_precision_keep_torchs_path():
    kv = KVCache(1, 300, H, D_HEAD)
    table = torch.arange(300).view(1, 300)
    many = KERNEL_QUERIES + 1
    plan = layout(table, torch.tensor([0]), torch.tensor([many]), torch.tensor([many]), None, many, 300)
    assert not in_place(torch.zeros(1, many, 9, D_HEAD), kv, plan)
    few = layout(table, torch.tensor([0]), torch.tensor([40]), torch.tensor([1]), None, 1, 300)
    assert in_place(torch.zeros(1, 1, 9, D_HEAD), kv, few)
    tree = torch.ones(1, 2, 2, dtype=torch.bool).tril()
    verify = layout(table, torch.tensor([0]), torch.tensor([40]), torch.tensor([2]), tree, 2, 300)
    assert not in_place(torch.zeros(1, 2, 9, D_HEAD), kv, verify)
    assert not in_place(torch.zeros(1, 1, 9, D_HEAD, dtype=torch.bfloat16), KVCache(1, 300, H, D_HEAD, torch.bfloat16), few)
    # A batch-invariant layout's blocks of one query each take the kernel, whose queries are computed
    # alone whatever the block count (torch's batched products are not, with MKL on AVX-512).
    invariant = layout(table, torch.tensor([0]), torch.tensor([40]), torch.tensor([1]), None, 1, 300, True)
    assert in_place(torch.zeros(1, 1, 9, D_HEAD), kv, invariant)

"""Semantics tier, int64 by value: indices, slots, positions and token ids past 2**31 (and past
2**32) come out of every op exactly, so a kernel that narrows any of them to 32 bits fails here.

The index ops get such values in small tensors. The ops that address the KV cache (``store_kv``,
``move_kv``, ``attention``) need a cache of more than 2**31 elements per layer for their element
offsets to pass 2**31 (8.6 GB in half precision): they run on an accelerator with room for it and
are skipped elsewhere (the CPU, a small device), saying so.
"""

from __future__ import annotations

import math

import pytest
import torch

from ngram_hal.kv_cache import KVCache

from . import cases, oracle
from .checks import assert_equal, host
from .test_alloc import _page_sizes
from .test_attention import TOLERANCE, dense_attention

conformance = pytest.mark.conformance
BIG = 2 ** 31
HEAD_DIM = 64


@conformance(op="alloc_extend", tier="semantics")
@pytest.mark.parametrize("page_size", [1, 16])
def test_alloc_extend_slots_past_2_31(backend, device, page_size):
    """Free pages whose slots straddle 2**31 and pass 2**32 and 2**40, and a partial last page
    past 2**34: the slots are the definition's."""
    if page_size not in _page_sizes(backend):
        pytest.skip(f"the backend lists page sizes {backend.capabilities().page_sizes}; this case uses {page_size}")
    p = page_size
    free = [BIG // p - 1, BIG // p, 2 ** 33 // p + 3, 2 ** 40 + 1, 2 ** 36 + 5, 2 ** 41 + 9, 7]
    prefix, seq = [0, 3, p], [p + 2, 3 + p, 2 * p + 1]
    last = [-1, 2 ** 34 + 2, 2 ** 35 + p - 1]  # request 1's prefix ends inside a page (p > 3) or fills it
    call = cases.Call("alloc_extend", {
        "prefix_lens": cases.index(prefix, device), "seq_lens": cases.index(seq, device),
        "last_loc": cases.index(last, device), "free_pages": cases.index(free, device), "page_size": p,
        "num_new_tokens": sum(seq) - sum(prefix)})
    assert_equal(call.run(backend), oracle.alloc_extend(prefix, seq, last, free, p), "alloc_extend")


@conformance(op=["assign_req_to_token", "gather_cache_locs"], tier="semantics")
def test_request_table_keeps_slots_past_2_31(backend, reference, device):
    """Slots around 2**31, past 2**32 and 2**40 (and -1) go into the request table and come back as written."""
    locs = [BIG - 1, BIG, BIG + 1, 2 ** 32 + 5, 2 ** 40 + 7, -1]
    rows, start, end = cases.index([2, 0], device), cases.index([1, 4], device), cases.index([4, 7], device)
    tables = [torch.zeros((3, 8), dtype=torch.int64, device=device) for _ in range(2)]
    for be, table in zip((backend, reference), tables):
        be.assign_req_to_token(table, rows, start, end, cases.index(locs, device))
    assert_equal(tables[0], tables[1], "req_to_token after assign_req_to_token")
    assert_equal(backend.gather_cache_locs(tables[0], rows, start, end, num_tokens=len(locs)), locs,
                 "gather_cache_locs")


@conformance(op="accepted_kv_moves", tier="semantics")
def test_accepted_kv_moves_past_2_31(backend, reference, device):
    """Tree slots and request-table slots past 2**31 and 2**32: the moves are the reference's."""
    args = {"out_cache_loc": cases.index([BIG + 7 * i for i in range(6)], device),
            "accept_index": cases.index([[0, 2, -1], [3, 4, 5]], device),
            "req_to_token": 2 ** 32 + torch.arange(24, dtype=torch.int64, device=device).view(3, 8),
            "req_pool_indices": cases.index([1, 2], device), "seq_lens": cases.index([2, 4], device)}
    got, want = backend.accepted_kv_moves(**args), reference.accepted_kv_moves(**args)
    for name, a, b in zip(("src", "dst"), got, want):
        assert_equal(a, b, f"accepted_kv_moves {name}")


@conformance(op="reconstruct_tree", tier="semantics")
def test_tree_positions_past_2_31(backend, reference, device):
    """Roots at positions 2**31 - 1 and 2**40: every node's position is its root's plus its depth."""
    mask = torch.tensor([[[i >= j for j in range(4)] for i in range(4)],
                         [[j == 0 or i == j for j in range(4)] for i in range(4)]], device=device)
    seq_lens = cases.index([BIG - 1, 2 ** 40], device)
    got, want = backend.reconstruct_tree(mask, seq_lens), reference.reconstruct_tree(mask, seq_lens)
    assert_equal(got[0], [BIG - 1, BIG, BIG + 1, BIG + 2, 2 ** 40, *[2 ** 40 + 1] * 3], "positions")
    for name, a, b in zip(("retrieve_index", "retrieve_next_token", "retrieve_next_sibling"), got[1:], want[1:]):
        assert_equal(a, b, name)


@conformance(op="verify_tree_greedy", tier="semantics")
def test_greedy_verify_token_ids_past_2_31(backend, reference, device):
    """Token ids past 2**31 and 2**32 are matched and committed exactly (a vocabulary that large is
    not the point: int64 all the way is)."""
    mask = torch.tensor([[[i >= j for j in range(4)] for i in range(4)]], device=device)
    tree = reference.reconstruct_tree(mask, cases.index([5], device))
    candidates = cases.index([[BIG + 1, BIG + 2, BIG + 3, 2 ** 32 + 4]], device)
    target = cases.index([[BIG + 2, BIG + 3, 2 ** 32 + 9, BIG + 5]], device)
    got = backend.verify_tree_greedy(candidates, *tree[1:], target)
    want = reference.verify_tree_greedy(candidates, *tree[1:], target)
    for name, a, b in zip(("predicts", "accept_index", "accept_len"), got, want):
        assert_equal(a, b, name)
    assert host(got[2]).tolist() == [3] and host(got[0])[:3].tolist() == [BIG + 2, BIG + 3, 2 ** 32 + 9]


# ---------------------------------------------------------------- a cache of more than 2**31 elements


def _big_cache(backend, device) -> KVCache:
    """One layer of one head whose slots pass 2**31 elements, zeroed; skips where it cannot fit."""
    dtype = next((d for d in (torch.bfloat16, torch.float16) if d in backend.kv_dtypes), backend.kv_dtypes[0])
    slots = BIG // HEAD_DIM + 64
    need = 2 * slots * HEAD_DIM * torch.empty((), dtype=dtype).element_size()
    dev = torch.device(device)
    if dev.type in ("cpu", "meta"):
        pytest.skip(f"a cache past 2**31 elements ({need / 2**30:.1f} GiB) runs on an accelerator, not the {dev.type}")
    module = torch.get_device_module(dev.type)
    free = module.mem_get_info(dev)[0] if hasattr(module, "mem_get_info") else 0
    if free < need + 2 ** 30:
        pytest.skip(f"a cache past 2**31 elements needs {need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB free on {dev}")
    return KVCache(1, slots, 1, HEAD_DIM, dtype, device)


@pytest.fixture
def big_cache(backend, device):
    return _big_cache(backend, device)


def _rows(n: int, dtype, device, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((n, 1, HEAD_DIM), generator=gen).to(dtype=dtype, device=device)


@conformance(op=["store_kv", "move_kv"], tier="semantics")
def test_kv_rows_past_2_31_elements(backend, device, big_cache):
    """store_kv and move_kv address rows whose element offsets pass 2**31, and touch no other row."""
    kv, S = big_cache, big_cache.num_slots
    k, v = _rows(3, kv.dtype, device, 1), _rows(3, kv.dtype, device, 2)
    locs = cases.index([S - 1, S - 3, 0], device)
    backend.store_kv(kv, 0, locs, k, v)
    assert torch.equal(host(kv.k[0, locs]), host(k)) and torch.equal(host(kv.v[0, locs]), host(v)), "store_kv rows"
    assert not bool(kv.k[0, S - 2].any()) and not bool(kv.v[0, 1].any()), "store_kv wrote a row it was not given"
    backend.move_kv(kv, cases.index([S - 1, 0], device), cases.index([1, S - 2], device))
    assert torch.equal(host(kv.k[0, 1]), host(k[0])) and torch.equal(host(kv.v[0, S - 2]), host(v[2])), "move_kv rows"


@conformance(op="attention", tier="semantics")
def test_attention_reads_rows_past_2_31_elements(backend, device, big_cache):
    """A request whose keys sit at element offsets past 2**31 attends to them: the result is the
    dense one over the same rows."""
    kv, S = big_cache, big_cache.num_slots
    slots = [S - 1, S - 3, 5, S - 64]
    kv.k[0, slots] = _rows(4, kv.dtype, device, 3)
    kv.v[0, slots] = _rows(4, kv.dtype, device, 4)
    q = _rows(2, kv.dtype, device, 5)
    table = cases.index([slots + [0] * 4], device)
    rows, kv_lens, q_lens = cases.index([0], device), cases.index([4], device), cases.index([2], device)
    scale = 1 / math.sqrt(HEAD_DIM)
    out = backend.attention(q, kv, 0, table, rows, kv_lens, q_lens, scale, max_kv_len=4)
    small = torch.arange(4, dtype=torch.int64).view(1, 4)
    want = dense_attention(q, host(kv.k[:, slots]), host(kv.v[:, slots]), 0, small, cases.index([0], "cpu"),
                           cases.index([4], "cpu"), cases.index([2], "cpu"), scale)
    atol, rtol = TOLERANCE[kv.dtype]
    torch.testing.assert_close(host(out).double(), want, atol=atol, rtol=rtol)

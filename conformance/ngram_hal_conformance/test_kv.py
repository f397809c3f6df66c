"""Semantics tier for store_kv, move_kv and accepted_kv_moves: K/V rows bit-exact and index
outputs exact against the reference backend and the ops' literal definitions; sentinel handling
(contract tier)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ngram_hal.kv_cache import KVCache

from . import cases, oracle
from .checks import assert_bitwise, assert_equal, assert_index_output, host, slots

conformance = pytest.mark.conformance
rngs = st.randoms(use_true_random=False)


def store_kv_call(rng: random.Random, device, kv: KVCache, n: int, holes: int) -> cases.Call:
    """``n`` distinct locs with ``holes`` -1 entries mixed in, random rows of the cache's dtype."""
    locs = rng.sample(range(kv.num_slots), n) + [-1] * holes
    rng.shuffle(locs)
    total = n + holes
    return cases.Call("store_kv", {
        "kv": kv, "layer": rng.randrange(kv.num_layers), "locs": cases.index(locs, device),
        "k": cases.random_rows(rng, device, total, kv.num_heads, kv.head_dim, kv.dtype),
        "v": cases.random_rows(rng, device, total, kv.num_heads, kv.head_dim, kv.dtype)})


MOVE_PATTERNS = ("random", "cycle", "chain")


def move_kv_call(rng: random.Random, device, kv: KVCache, n: int, pattern: str, sentinel_rate: float = 0.0,
                 identity_rate: float = 0.0) -> cases.Call:
    """``n`` move pairs over the cache's slots with distinct destinations.

    ``random``: any sources (often other pairs' destinations); ``cycle``: a permutation of ``n``
    slots (cycles, fixed points are ``src == dst``); ``chain``: ``a0->a1->...->an``. The pair order
    is shuffled. Then each pair turns into ``src == dst`` with ``identity_rate`` and gets a -1 on
    one side with ``sentinel_rate``.
    """
    S = kv.num_slots
    if pattern == "random":
        dst = rng.sample(range(S), n)
        src = [rng.randrange(S) for _ in range(n)]
    elif pattern == "cycle":
        src = rng.sample(range(S), n)
        dst = src[:]
        rng.shuffle(dst)
    elif pattern == "chain":
        slots = rng.sample(range(S), n + 1)
        src, dst = slots[:-1], slots[1:]
    else:
        raise ValueError(f"unknown move pattern {pattern!r}")
    pairs = list(zip(src, dst))
    rng.shuffle(pairs)
    src, dst = [s for s, _ in pairs], [d for _, d in pairs]
    for i in range(n):
        if rng.random() < identity_rate:
            src[i] = dst[i]
        if rng.random() < sentinel_rate:
            if rng.random() < 0.5:
                src[i] = -1
            else:
                dst[i] = -1
    return cases.Call("move_kv", {"kv": kv, "src": cases.index(src, device), "dst": cases.index(dst, device)},
                {"pattern": pattern})


def accepted_kv_moves_call(rng: random.Random, device, batch: int, depth: int, rows: int, max_context: int,
                           num_slots: int) -> cases.Call:
    """B draft trees of D nodes in distinct slots; per request a root-first increasing run of
    accepted nodes (-1 padded); random ``req_to_token`` rows and ``seq_lens + D <= M``."""
    B, D = batch, depth
    out_cache_loc = rng.sample(range(num_slots), B * D)
    accept = []
    for b in range(B):
        n = rng.randint(1, D)
        nodes = [0] + sorted(rng.sample(range(1, D), n - 1))
        accept.append([b * D + i for i in nodes] + [-1] * (D - n))
    table = [[rng.randrange(num_slots) for _ in range(max_context)] for _ in range(rows)]
    return cases.Call("accepted_kv_moves", {
        "out_cache_loc": cases.index(out_cache_loc, device), "accept_index": cases.index(accept, device),
        "req_to_token": cases.index(table, device), "req_pool_indices": cases.index(rng.sample(range(rows), B), device),
        "seq_lens": cases.index([rng.randint(0, max_context - D) for _ in range(B)], device)})


@cases.minimal_call("store_kv")
def _minimal_store(rng, device, page_size, dtype):
    return store_kv_call(rng, device, cases.random_kv(rng, device, 2, 16, 2, 4, dtype), n=5, holes=2)


@cases.minimal_call("move_kv")
def _minimal_move(rng, device, page_size, dtype):
    return move_kv_call(rng, device, cases.random_kv(rng, device, 2, 16, 2, 4, dtype), n=6, pattern="chain",
                        sentinel_rate=0.3)


@cases.minimal_call("accepted_kv_moves")
def _minimal_accepted(rng, device, page_size, dtype):
    return accepted_kv_moves_call(rng, device, batch=3, depth=4, rows=5, max_context=12, num_slots=32)


def _timed_cache(rng, backend, device):
    dtype = cases.kv_half_dtype(backend)
    kv = cases.random_kv(rng, device, cases.TIMED_LAYERS, cases.TIMED_SLOTS, cases.TIMED_HEADS,
                         cases.TIMED_HEAD_DIM, dtype)
    what = (f"{cases.TIMED_LAYERS} layers x {cases.TIMED_SLOTS} slots x {cases.TIMED_HEADS} heads x "
            f"{cases.TIMED_HEAD_DIM}, {str(dtype).removeprefix('torch.')}")
    return kv, what


@cases.timed_call("store_kv")
def _timed_store(rng, backend, device):
    kv, what = _timed_cache(rng, backend, device)
    rows = cases.TIMED_BATCH * cases.TIMED_NODES
    return store_kv_call(rng, device, kv, rows, 0), f"{rows} rows into one layer of {what}"


@cases.timed_call("move_kv")
def _timed_move(rng, backend, device):
    kv, what = _timed_cache(rng, backend, device)
    pairs = cases.TIMED_BATCH * cases.TIMED_NODES
    slots_ = rng.sample(range(cases.TIMED_SLOTS), 2 * pairs)
    return (cases.Call("move_kv", {"kv": kv, "src": cases.index(slots_[:pairs], device),
                                   "dst": cases.index(slots_[pairs:], device)}),
            f"{pairs} pairs over {what}")


@cases.timed_call("accepted_kv_moves")
def _timed_accepted(rng, backend, device):
    B, D, context = cases.TIMED_BATCH, cases.TIMED_NODES, cases.TIMED_CONTEXT
    return (accepted_kv_moves_call(rng, device, B, D, B, context, B * context),
            f"{B} requests x {D} nodes, contexts of {context}")


def _kv_dtypes(backend) -> list[torch.dtype]:
    return [getattr(torch, name) for name in backend.capabilities().kv_dtypes]


def _cache(backend, device, seed, layers: int, num_slots: int, heads: int, head_dim: int):
    """A random KV cache of a dtype the backend lists."""
    return cases.random_kv(random.Random(seed), device, layers, num_slots, heads, head_dim, cases.supported(backend)[1])


def _assert_kv(mine, ref, expected_k, expected_v, what: str) -> None:
    """``mine`` equals ``ref`` and the expected K/V on every data row, bit for bit."""
    S = mine.num_slots
    assert_bitwise(slots(mine.k, S), slots(ref.k, S), f"{what}: K vs reference")
    assert_bitwise(slots(mine.v, S), slots(ref.v, S), f"{what}: V vs reference")
    assert_bitwise(slots(mine.k, S), slots(expected_k, S), f"{what}: K vs definition")
    assert_bitwise(slots(mine.v, S), slots(expected_v, S), f"{what}: V vs definition")


def _run_kv(backend, reference, call: cases.Call):
    mine, ref = call.clone(), call.clone()
    assert mine.run(backend) is None
    ref.run(reference)
    return mine.args["kv"], ref.args["kv"]


@conformance(op="store_kv", tier="semantics")
@given(data=st.data(), rng=rngs, layers=st.integers(1, 3), num_slots=st.integers(1, 32),
       heads=st.integers(1, 3), head_dim=st.sampled_from([1, 4, 8]), holes=st.integers(0, 3))
def test_store_kv_matches(backend, reference, device, data, rng, layers, num_slots, heads, head_dim, holes):
    dtype = data.draw(st.sampled_from(_kv_dtypes(backend)), label="dtype")
    n = data.draw(st.integers(0, num_slots), label="n")
    kv = cases.random_kv(rng, device, layers, num_slots, heads, head_dim, dtype)
    call = store_kv_call(rng, device, kv, n, holes)
    mine, ref = _run_kv(backend, reference, call)
    locs, layer = call.args["locs"].tolist(), call.args["layer"]
    _assert_kv(mine, ref, oracle.store_kv(host(kv.k), layer, locs, host(call.args["k"])),
               oracle.store_kv(host(kv.v), layer, locs, host(call.args["v"])), "store_kv")


@conformance(op="move_kv", tier="semantics")
@given(data=st.data(), rng=rngs, pattern=st.sampled_from(MOVE_PATTERNS), num_slots=st.integers(2, 48),
       layers=st.integers(1, 3), sentinel_rate=st.sampled_from([0.0, 0.3]),
       identity_rate=st.sampled_from([0.0, 0.2]))
def test_move_kv_matches(backend, reference, device, data, rng, pattern, num_slots, layers, sentinel_rate,
                         identity_rate):
    """Random, cyclic and chained move sets with -1 pairs and src == dst pairs."""
    dtype = data.draw(st.sampled_from(_kv_dtypes(backend)), label="dtype")
    n = data.draw(st.integers(1, num_slots - 1 if pattern == "chain" else num_slots), label="n")
    kv = cases.random_kv(rng, device, layers, num_slots, 2, 4, dtype)
    call = move_kv_call(rng, device, kv, n, pattern, sentinel_rate, identity_rate)
    mine, ref = _run_kv(backend, reference, call)
    src, dst = call.args["src"].tolist(), call.args["dst"].tolist()
    _assert_kv(mine, ref, oracle.move_kv(host(kv.k), src, dst), oracle.move_kv(host(kv.v), src, dst), "move_kv")


MOVE_SETS = {
    "swap": ([3, 7], [7, 3]),
    "cycle3": ([1, 2, 3], [2, 3, 1]),
    "chain_forward": ([0, 1, 2, 3], [1, 2, 3, 4]),
    "chain_backward": ([3, 2, 1, 0], [4, 3, 2, 1]),
    "fan_out": ([5, 5, 5], [5, 6, 7]),
    "tree_compaction": ([9, 11, 14], [8, 9, 10]),
}


@conformance(op="move_kv", tier="semantics")
@pytest.mark.parametrize("name", list(MOVE_SETS))
def test_move_kv_overlapping_sets(backend, reference, device, name):
    """Fixed overlapping move sets: every source is read before any destination is written."""
    src, dst = MOVE_SETS[name]
    kv = _cache(backend, device, name, 2, 16, 2, 4)
    call = cases.Call("move_kv", {"kv": kv, "src": cases.index(src, device), "dst": cases.index(dst, device)})
    mine, ref = _run_kv(backend, reference, call)
    _assert_kv(mine, ref, oracle.move_kv(host(kv.k), src, dst), oracle.move_kv(host(kv.v), src, dst), name)


@conformance(op="accepted_kv_moves", tier="semantics")
@given(rng=rngs, batch=st.integers(1, 8), depth=st.integers(1, 8), extra_rows=st.integers(0, 3),
       extra_context=st.integers(0, 20), extra_slots=st.integers(0, 16))
def test_accepted_kv_moves_matches(backend, reference, device, rng, batch, depth, extra_rows, extra_context,
                                   extra_slots):
    call = accepted_kv_moves_call(rng, device, batch, depth, batch + extra_rows, depth + extra_context,
                                   batch * depth + extra_slots)
    src, dst = call.run(backend)
    assert_index_output(src, device, (batch * depth,), "accepted_kv_moves src")
    assert_index_output(dst, device, (batch * depth,), "accepted_kv_moves dst")
    ref_src, ref_dst = call.run(reference)
    assert_equal(src, ref_src, "src vs reference")
    assert_equal(dst, ref_dst, "dst vs reference")
    a = {k: v.tolist() for k, v in call.args.items()}
    want_src, want_dst = oracle.accepted_kv_moves(a["out_cache_loc"], a["accept_index"], a["req_to_token"],
                                                  a["req_pool_indices"], a["seq_lens"])
    assert_equal(src, want_src, "src vs definition")
    assert_equal(dst, want_dst, "dst vs definition")


# ---------------------------------------------------------------- sentinels (contract tier)

@conformance(op="store_kv", tier="contract")
def test_store_kv_skips_sentinel(backend, device):
    """Rows aimed at loc -1 are written nowhere; the other rows land where they should."""
    kv = _cache(backend, device, 0, 2, 8, 2, 4)
    before_k, before_v = host(kv.k).clone(), host(kv.v).clone()
    k = cases.random_rows(random.Random(1), device, 4, 2, 4, kv.dtype)
    v = cases.random_rows(random.Random(2), device, 4, 2, 4, kv.dtype)
    backend.store_kv(kv, 1, cases.index([-1, 6, -1, 2], device), k, v)
    want_k, want_v = before_k.clone(), before_v.clone()
    want_k[1, 6], want_k[1, 2] = host(k[1]), host(k[3])
    want_v[1, 6], want_v[1, 2] = host(v[1]), host(v[3])
    assert_bitwise(slots(kv.k, 8), slots(want_k, 8), "K after a store with -1 locs")
    assert_bitwise(slots(kv.v, 8), slots(want_v, 8), "V after a store with -1 locs")


@conformance(op="move_kv", tier="contract")
def test_move_kv_skips_sentinel_and_identity(backend, device):
    """Pairs with -1 on either side and pairs with src == dst change nothing."""
    kv = _cache(backend, device, 0, 2, 8, 2, 4)
    before_k, before_v = host(kv.k).clone(), host(kv.v).clone()
    backend.move_kv(kv, cases.index([-1, 3, 4, -1, 5], device), cases.index([2, -1, 4, -1, 5], device))
    assert_bitwise(slots(kv.k, 8), slots(before_k, 8), "K after no-op moves")
    assert_bitwise(slots(kv.v, 8), slots(before_v, 8), "V after no-op moves")


@conformance(op="move_kv", tier="contract")
def test_move_kv_dead_pair_may_share_dst(backend, device):
    """A pair with src -1 does nothing, even when its dst is another pair's dst."""
    kv = _cache(backend, device, 0, 2, 8, 2, 4)
    want_k, want_v = host(kv.k).clone(), host(kv.v).clone()
    want_k[:, 5], want_v[:, 5] = want_k[:, 1].clone(), want_v[:, 1].clone()
    backend.move_kv(kv, cases.index([1, -1], device), cases.index([5, 5], device))
    assert_bitwise(slots(kv.k, 8), slots(want_k, 8), "K")
    assert_bitwise(slots(kv.v, 8), slots(want_v, 8), "V")


@conformance(op="move_kv", tier="contract")
def test_move_kv_empty(backend, device):
    kv = _cache(backend, device, 0, 1, 4, 1, 2)
    before = host(kv.k).clone()
    backend.move_kv(kv, cases.index([], device), cases.index([], device))
    assert_bitwise(slots(kv.k, 4), slots(before, 4), "K after no moves")


@conformance(op="accepted_kv_moves", tier="contract")
def test_accepted_kv_moves_pads_with_sentinel(backend, device):
    """Entries from the first -1 of accept_index on are -1 in both outputs."""
    call = cases.Call("accepted_kv_moves", {
        "out_cache_loc": cases.index([10, 11, 12, 13, 20, 21, 22, 23], device),
        "accept_index": cases.index([[0, 2, -1, -1], [4, -1, -1, -1]], device),
        "req_to_token": cases.index([list(range(100, 108)), list(range(200, 208))], device),
        "req_pool_indices": cases.index([1, 0], device), "seq_lens": cases.index([3, 1], device)})
    src, dst = call.run(backend)
    assert_equal(src, [10, 12, -1, -1, 20, -1, -1, -1], "src")
    assert_equal(dst, [203, 204, -1, -1, 101, -1, -1, -1], "dst")

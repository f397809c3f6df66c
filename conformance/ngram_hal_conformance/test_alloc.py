"""Semantics tier for alloc_extend, assign_req_to_token and gather_cache_locs: exact equality
with the reference backend and with the ops' literal definitions (``oracle``)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from . import cases, oracle
from .checks import assert_equal, assert_index_output

conformance = pytest.mark.conformance
PAGE_SIZES = (1, 2, 4, 16)
rngs = st.randoms(use_true_random=False)


def alloc_extend_call(rng: random.Random, device, batch: int, page_size: int, max_len: int, spare_pages: int = 2,
                      extend: int | None = None) -> cases.Call:
    """B requests with random prefixes (up to ``max_len``) held in random pages, extended by random
    lengths up to ``max_len`` (by ``extend`` each when given); the free list holds the remaining
    pages in random order (enough, plus ``spare_pages``)."""
    prefix = [rng.randint(0, max_len) for _ in range(batch)]
    seq = [p + (rng.randint(0, max_len) if extend is None else extend) for p in prefix]
    held = [math.ceil(p / page_size) for p in prefix]
    need = [math.ceil(s / page_size) - h for s, h in zip(seq, held)]
    pages = list(range(sum(held) + sum(need) + spare_pages))
    rng.shuffle(pages)
    last_loc, at = [], 0
    for b in range(batch):
        own = pages[at:at + held[b]]
        at += held[b]
        last_loc.append(own[-1] * page_size + (prefix[b] - 1) % page_size if own else -1)
    free = pages[at:]
    return cases.Call("alloc_extend", {
        "prefix_lens": cases.index(prefix, device), "seq_lens": cases.index(seq, device), "last_loc": cases.index(last_loc, device),
        "free_pages": cases.index(free, device), "page_size": page_size,
        "num_new_tokens": sum(s - p for s, p in zip(seq, prefix))})


def _loc(rng: random.Random, num_slots: int) -> int:
    """A slot id, or -1 one time in four."""
    return -1 if rng.random() < 0.25 else rng.randrange(num_slots)


def _req_rows(rng: random.Random, device, batch: int, rows: int, max_context: int, num_slots: int):
    table = [[_loc(rng, num_slots) for _ in range(max_context)] for _ in range(rows)]
    pool = rng.sample(range(rows), batch)
    bounds = [sorted((rng.randint(0, max_context), rng.randint(0, max_context))) for _ in range(batch)]
    args = {"req_to_token": cases.index(table, device), "req_pool_indices": cases.index(pool, device),
            "start": cases.index([a for a, _ in bounds], device), "end": cases.index([b for _, b in bounds], device)}
    return args, sum(b - a for a, b in bounds)


def assign_req_to_token_call(rng: random.Random, device, batch: int, rows: int, max_context: int,
                             num_slots: int = 64) -> cases.Call:
    """Distinct request rows, random ``start <= end`` ranges, random locs (a quarter -1)."""
    args, n = _req_rows(rng, device, batch, rows, max_context, num_slots)
    args["locs"] = cases.index([_loc(rng, num_slots) for _ in range(n)], device)
    return cases.Call("assign_req_to_token", args)


def gather_cache_locs_call(rng: random.Random, device, batch: int, rows: int, max_context: int,
                           num_slots: int = 64) -> cases.Call:
    """Distinct request rows and random ``start <= end`` ranges over a random table (a quarter -1)."""
    args, n = _req_rows(rng, device, batch, rows, max_context, num_slots)
    args["num_tokens"] = n
    return cases.Call("gather_cache_locs", args)


@cases.minimal_call("alloc_extend")
def _minimal_alloc_extend(rng, device, page_size, dtype):
    return alloc_extend_call(rng, device, batch=3, page_size=page_size, max_len=9)


@cases.minimal_call("assign_req_to_token")
def _minimal_assign(rng, device, page_size, dtype):
    return assign_req_to_token_call(rng, device, batch=3, rows=4, max_context=12)


@cases.minimal_call("gather_cache_locs")
def _minimal_gather(rng, device, page_size, dtype):
    return gather_cache_locs_call(rng, device, batch=3, rows=4, max_context=12)


@cases.timed_call("alloc_extend")
def _timed_alloc_extend(rng, backend, device):
    B, D, context = cases.TIMED_BATCH, cases.TIMED_NODES, cases.TIMED_CONTEXT
    page_size = cases.supported(backend)[0]
    call = alloc_extend_call(rng, device, B, page_size, context, extend=D)
    return call, f"{B} requests extended by {D} tokens, contexts up to {context}, page size {page_size}"


def _timed_table(device):
    B, context = cases.TIMED_BATCH, cases.TIMED_CONTEXT
    table = torch.randint(0, B * context, (B, context), generator=torch.Generator().manual_seed(0)).to(device)
    rows = torch.randperm(B, generator=torch.Generator().manual_seed(1)).to(device)
    return table, rows


@cases.timed_call("assign_req_to_token")
def _timed_assign(rng, backend, device):
    B, D, context = cases.TIMED_BATCH, cases.TIMED_NODES, cases.TIMED_CONTEXT
    table, rows = _timed_table(device)
    start = torch.randint(0, context - D, (B,), generator=torch.Generator().manual_seed(2)).to(device)
    locs = torch.arange(B * D, dtype=torch.int64, device=device)
    return (cases.Call("assign_req_to_token", {"req_to_token": table, "req_pool_indices": rows, "start": start,
                                               "end": start + D, "locs": locs}),
            f"{B} requests x {D} tokens into a {B} x {context} table")


@cases.timed_call("gather_cache_locs")
def _timed_gather(rng, backend, device):
    B, context = cases.TIMED_BATCH, cases.TIMED_CONTEXT
    table, rows = _timed_table(device)
    zeros, ends = torch.zeros(B, dtype=torch.int64, device=device), torch.full((B,), context, device=device)
    return (cases.Call("gather_cache_locs", {"req_to_token": table, "req_pool_indices": rows, "start": zeros,
                                             "end": ends, "num_tokens": B * context}),
            f"{B} whole contexts of {context} tokens")


def _page_sizes(backend) -> list[int]:
    listed = backend.capabilities().page_sizes
    return [p for p in PAGE_SIZES if listed is None or p in listed] or list(listed)


@conformance(op="alloc_extend", tier="semantics")
@given(data=st.data(), rng=rngs, batch=st.integers(1, 8), max_len=st.integers(0, 40), spare=st.integers(0, 3))
def test_alloc_extend_matches(backend, reference, device, data, rng, batch, max_len, spare):
    page_size = data.draw(st.sampled_from(_page_sizes(backend)), label="page_size")
    call = alloc_extend_call(rng, device, batch, page_size, max_len, spare)
    got = call.run(backend)
    assert_index_output(got, device, (call.args["num_new_tokens"],), "alloc_extend output")
    assert_equal(got, call.run(reference), "alloc_extend vs reference")
    a = {k: v.tolist() for k, v in call.args.items() if k in cases.TENSOR_ARGS["alloc_extend"]}
    want = oracle.alloc_extend(a["prefix_lens"], a["seq_lens"], a["last_loc"], a["free_pages"], page_size)
    assert_equal(got, want, "alloc_extend vs definition")


@conformance(op="alloc_extend", tier="semantics")
def test_alloc_extend_fills_partial_page_first(backend, device):
    """A request whose prefix ends inside a page continues there before taking a new page."""
    if 4 not in _page_sizes(backend):
        pytest.skip(f"the backend lists page sizes {backend.capabilities().page_sizes}; this case uses 4")
    # Request 0: empty prefix. Request 1: 5 tokens in pages 2, 3 (last at slot 12). Request 2: none new.
    call = cases.Call("alloc_extend", {
        "prefix_lens": cases.index([0, 5, 8], device), "seq_lens": cases.index([3, 10, 8], device),
        "last_loc": cases.index([-1, 12, 23], device), "free_pages": cases.index([7, 9, 10, 12], device),
        "page_size": 4, "num_new_tokens": 8})
    assert_equal(call.run(backend), [28, 29, 30, 13, 14, 15, 36, 37], "alloc_extend")


@conformance(op="alloc_extend", tier="semantics")
@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
def test_alloc_extend_page_boundaries(backend, reference, device, page_size):
    """Prefixes ending exactly on a page boundary (the next token opens a new page), one short of
    it and one past it, extended across one or more boundaries."""
    if page_size not in _page_sizes(backend):
        pytest.skip(f"the backend lists page sizes {backend.capabilities().page_sizes}")
    p = page_size
    prefix = [p, 2 * p, p - 1, p + 1, 0, 3 * p]
    seq = [p + 1, 3 * p + 1, 2 * p, 2 * p + 1, p, 3 * p]
    held = [-(-n // p) for n in prefix]
    pages = list(range(3, 3 + sum(held) + 12))[::-1]  # descending ids, so page order matters
    last_loc, at = [], 0
    for n, h in zip(prefix, held):
        last_loc.append(pages[at + h - 1] * p + (n - 1) % p if h else -1)
        at += h
    free = pages[at:]
    call = cases.Call("alloc_extend", {
        "prefix_lens": cases.index(prefix, device), "seq_lens": cases.index(seq, device),
        "last_loc": cases.index(last_loc, device), "free_pages": cases.index(free, device), "page_size": p,
        "num_new_tokens": sum(seq) - sum(prefix)})
    got = call.run(backend)
    assert_equal(got, oracle.alloc_extend(prefix, seq, last_loc, free, p), f"page size {p} vs definition")
    assert_equal(got, call.run(reference), f"page size {p} vs reference")


@conformance(op="assign_req_to_token", tier="semantics")
def test_assign_shared_row_disjoint_ranges(backend, reference, device):
    """Requests may share a row when their ranges are disjoint (empty ranges anywhere)."""
    table = [[-1] * 10 for _ in range(3)]
    rows, start, end = [2, 0, 2, 2], [0, 1, 6, 4], [4, 5, 9, 4]
    locs = list(range(20, 31))
    call = cases.Call("assign_req_to_token", {
        "req_to_token": cases.index(table, device), "req_pool_indices": cases.index(rows, device),
        "start": cases.index(start, device), "end": cases.index(end, device), "locs": cases.index(locs, device)})
    mine, ref = call.clone(), call.clone()
    mine.run(backend)
    ref.run(reference)
    assert_equal(mine.args["req_to_token"], oracle.assign_req_to_token(table, rows, start, end, locs), "vs definition")
    assert_equal(mine.args["req_to_token"], ref.args["req_to_token"], "vs reference")


@conformance(op="assign_req_to_token", tier="semantics")
@given(rng=rngs, batch=st.integers(1, 8), extra_rows=st.integers(0, 3), max_context=st.integers(1, 24))
def test_assign_req_to_token_matches(backend, reference, device, rng, batch, extra_rows, max_context):
    call = assign_req_to_token_call(rng, device, batch, batch + extra_rows, max_context)
    mine, ref = call.clone(), call.clone()
    assert mine.run(backend) is None
    ref.run(reference)
    assert_equal(mine.args["req_to_token"], ref.args["req_to_token"], "req_to_token vs reference")
    a = {k: v.tolist() for k, v in call.args.items()}
    want = oracle.assign_req_to_token(a["req_to_token"], a["req_pool_indices"], a["start"], a["end"], a["locs"])
    assert_equal(mine.args["req_to_token"], want, "req_to_token vs definition")


@conformance(op="gather_cache_locs", tier="semantics")
@given(rng=rngs, batch=st.integers(1, 8), extra_rows=st.integers(0, 3), max_context=st.integers(1, 24))
def test_gather_cache_locs_matches(backend, reference, device, rng, batch, extra_rows, max_context):
    call = gather_cache_locs_call(rng, device, batch, batch + extra_rows, max_context)
    got = call.run(backend)
    assert_index_output(got, device, (call.args["num_tokens"],), "gather_cache_locs output")
    assert_equal(got, call.run(reference), "gather_cache_locs vs reference")
    a = {k: v.tolist() for k, v in call.args.items() if k != "num_tokens"}
    want = oracle.gather_cache_locs(a["req_to_token"], a["req_pool_indices"], a["start"], a["end"])
    assert_equal(got, want, "gather_cache_locs vs definition")


@conformance(op=("assign_req_to_token", "gather_cache_locs"), tier="semantics")
@given(rng=rngs, batch=st.integers(1, 8), max_context=st.integers(1, 24))
def test_gather_inverts_assign(backend, device, rng, batch, max_context):
    """gather_cache_locs over the ranges just assigned returns the assigned locs."""
    call = assign_req_to_token_call(rng, device, batch, batch, max_context)
    call.run(backend)
    args = {k: call.args[k] for k in ("req_to_token", "req_pool_indices", "start", "end")}
    back = backend.gather_cache_locs(**args, num_tokens=call.args["locs"].numel())
    assert_equal(back, call.args["locs"], "gather after assign")


@conformance(op=("assign_req_to_token", "gather_cache_locs"), tier="contract")
def test_sentinel_locs_are_data(backend, device):
    """In the cache-location table -1 is a value like any other: assign writes it over whatever
    the cell held and gather returns it."""
    table = cases.index([[7, 7, 7, 7, 7], [8, 8, 8, 8, 8]], device)
    rows, start, end = cases.index([1, 0], device), cases.index([1, 0], device), cases.index([4, 2], device)
    locs = [-1, 3, -1, 5, -1]
    backend.assign_req_to_token(table, rows, start, end, cases.index(locs, device))
    assert_equal(table, [[5, -1, 7, 7, 7], [8, -1, 3, -1, 8]], "req_to_token after assigning -1 locs")
    assert_equal(backend.gather_cache_locs(table, rows, start, end, num_tokens=5), locs, "gathered locs")

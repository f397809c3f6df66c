"""Semantics tier for alloc_extend, assign_req_to_token and gather_cache_locs: exact equality
with the reference backend and with the ops' literal definitions (``oracle``)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from . import cases, oracle
from .checks import assert_equal, assert_index_output

conformance = pytest.mark.conformance
PAGE_SIZES = (1, 2, 4, 16)
rngs = st.randoms(use_true_random=False)


def _page_sizes(backend) -> list[int]:
    listed = backend.capabilities().page_sizes
    return [p for p in PAGE_SIZES if listed is None or p in listed] or list(listed)


@conformance(op="alloc_extend", tier="semantics")
@given(data=st.data(), rng=rngs, batch=st.integers(1, 8), max_len=st.integers(0, 40), spare=st.integers(0, 3))
def test_alloc_extend_matches(backend, reference, device, data, rng, batch, max_len, spare):
    page_size = data.draw(st.sampled_from(_page_sizes(backend)), label="page_size")
    call = cases.alloc_extend(rng, device, batch, page_size, max_len, spare)
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
    call = cases.assign_req_to_token(rng, device, batch, batch + extra_rows, max_context)
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
    call = cases.gather_cache_locs(rng, device, batch, batch + extra_rows, max_context)
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
    call = cases.assign_req_to_token(rng, device, batch, batch, max_context)
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

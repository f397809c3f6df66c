"""Performance tier: the time of one call of each op at sizes that mean something on a GPU
(a decode step of 64 requests with 8-node trees, a 30-layer cache, attention over a few thousand
tokens), recorded as report properties and shown in the matrix. Measured, never pass/fail.

Each op runs once to warm up, then ``REPEATS`` times between two ``synchronize()`` calls:
``eager_ms`` is the mean. Where ``backend.runtime.graph_capture`` is true the same call is
captured into a graph and replayed the same way: ``graph_ms`` (``graph_error`` when the op cannot
be captured, e.g. because it reads device data on the host). The backend is the
``unchecked_backend`` (``strict=False``): strict value checks would time host syncs.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from ngram_hal.backend import OPS

from . import cases

conformance = pytest.mark.conformance
# JUnit's xunit2 schema has no per-test properties, but pytest writes them into the XML anyway (as
# it writes the plugin's conformance.* properties), so its warning about record_property adds nothing.
pytestmark = pytest.mark.filterwarnings("ignore:record_property is incompatible with junit_family")

REPEATS = 5
BATCH, NODES = 64, 8
CONTEXT = 4096
LAYERS, SLOTS, HEADS, HEAD_DIM = 30, 2048, 4, 64
VOCAB = 32000
SAMPLE_BATCH = 8
ATTENTION_BATCH, QUERY_HEADS = 4, 16


def _kv_dtype(backend) -> torch.dtype:
    """A half type the backend lists (the usual KV dtype on accelerators), else its first."""
    listed = backend.capabilities().kv_dtypes
    name = next((d for d in ("float16", "bfloat16") if d in listed), listed[0])
    return getattr(torch, name)


def _chain_trees(batch: int, depth: int, device) -> torch.Tensor:
    return torch.ones(depth, depth, dtype=torch.bool, device=device).tril().expand(batch, depth, depth).contiguous()


def _tree_links(backend, batch: int, depth: int, device):
    """The retrieve links of ``batch`` trees: a root with two children, then chains below them."""
    parents = [-1, 0, 0] + [i - 2 for i in range(3, depth)]
    mask = torch.zeros(depth, depth, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] = mask[p]
        mask[i, i] = True
    tree = backend.reconstruct_tree(mask.expand(batch, depth, depth).contiguous().to(device),
                                    torch.zeros(batch, dtype=torch.int64, device=device))
    return tree[1:]


def _workload(op: str, backend, device) -> tuple[cases.Call, str]:
    """A call of ``op`` at a size worth timing, and what it holds in words."""
    rng = random.Random(op)
    B, D = BATCH, NODES
    if op == "alloc_extend":
        page_size = cases.supported(backend)[0]
        call = cases.alloc_extend(rng, device, B, page_size, CONTEXT, extend=D)
        return call, f"{B} requests extended by {D} tokens, contexts up to {CONTEXT}, page size {page_size}"
    if op in ("assign_req_to_token", "gather_cache_locs"):
        table = torch.randint(0, B * CONTEXT, (B, CONTEXT), generator=torch.Generator().manual_seed(0)).to(device)
        rows = torch.randperm(B, generator=torch.Generator().manual_seed(1)).to(device)
        if op == "gather_cache_locs":
            zeros, ends = torch.zeros(B, dtype=torch.int64, device=device), torch.full((B,), CONTEXT, device=device)
            return (cases.Call(op, {"req_to_token": table, "req_pool_indices": rows, "start": zeros, "end": ends,
                                    "num_tokens": B * CONTEXT}),
                    f"{B} whole contexts of {CONTEXT} tokens")
        start = torch.randint(0, CONTEXT - D, (B,), generator=torch.Generator().manual_seed(2)).to(device)
        locs = torch.arange(B * D, dtype=torch.int64, device=device)
        return (cases.Call(op, {"req_to_token": table, "req_pool_indices": rows, "start": start, "end": start + D,
                                "locs": locs}),
                f"{B} requests x {D} tokens into a {B} x {CONTEXT} table")
    if op in ("store_kv", "move_kv"):
        dtype = _kv_dtype(backend)
        kv = cases.random_kv(rng, device, LAYERS, SLOTS, HEADS, HEAD_DIM, dtype)
        what = f"{LAYERS} layers x {SLOTS} slots x {HEADS} heads x {HEAD_DIM}, {str(dtype).removeprefix('torch.')}"
        if op == "store_kv":
            return cases.store_kv(rng, device, kv, B * D, 0), f"{B * D} rows into one layer of {what}"
        slots = rng.sample(range(SLOTS), 2 * B * D)
        return (cases.Call(op, {"kv": kv, "src": cases.index(slots[:B * D], device),
                                "dst": cases.index(slots[B * D:], device)}),
                f"{B * D} pairs over {what}")
    if op == "accepted_kv_moves":
        return (cases.accepted_kv_moves(rng, device, B, D, B, CONTEXT, B * CONTEXT),
                f"{B} requests x {D} nodes, contexts of {CONTEXT}")
    if op == "reconstruct_tree":
        return (cases.Call(op, {"tree_mask": _chain_trees(B, D, device),
                                "seq_lens": torch.full((B,), CONTEXT, dtype=torch.int64, device=device)}),
                f"{B} trees of {D} nodes")
    if op == "verify_tree_greedy":
        links = _tree_links(backend, B, D, device)
        tokens = torch.randint(0, 4, (B, D), generator=torch.Generator().manual_seed(3)).to(device)
        return (cases.Call(op, {"candidates": tokens, "retrieve_index": links[0], "retrieve_next_token": links[1],
                                "retrieve_next_sibling": links[2], "target_predict": tokens.roll(-1, 1).contiguous()}),
                f"{B} trees of {D} nodes")
    if op == "verify_tree_sample":
        B = SAMPLE_BATCH
        links = _tree_links(backend, B, D, device)
        gen = torch.Generator().manual_seed(4)
        probs = torch.softmax(torch.randn(B, D, VOCAB, generator=gen), -1).to(device)
        return (cases.Call(op, {"candidates": torch.randint(0, VOCAB, (B, D), generator=gen).to(device),
                                "retrieve_index": links[0], "retrieve_next_token": links[1],
                                "retrieve_next_sibling": links[2], "target_probs": probs,
                                "uniform_samples": torch.rand(B, D, generator=gen).to(device),
                                "uniform_final": torch.rand(B, generator=gen).to(device)}),
                f"{B} trees of {D} nodes, vocabulary {VOCAB}")
    raise ValueError(f"unknown op {op!r}")


def _attention_workload(kind: str, backend, device) -> tuple[cases.Call, str]:
    """A decode step (one query each) or a tree verify (D nodes each) of a few requests of
    ``CONTEXT`` tokens; one layer's call."""
    B, D, dtype = ATTENTION_BATCH, NODES, _kv_dtype(backend)
    q_len = 1 if kind == "decode" else D
    kv = cases.random_kv(random.Random(kind), device, 1, B * CONTEXT, HEADS, HEAD_DIM, dtype)
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(B * CONTEXT, generator=gen).view(B, CONTEXT).to(device)
    call = cases.Call("attention", {
        "q": torch.randn(B * q_len, QUERY_HEADS, HEAD_DIM, generator=gen).to(dtype).to(device), "kv": kv, "layer": 0,
        "req_to_token": table, "req_pool_indices": torch.arange(B, dtype=torch.int64, device=device),
        "kv_lens": torch.full((B,), CONTEXT, dtype=torch.int64, device=device),
        "q_lens": torch.full((B,), q_len, dtype=torch.int64, device=device), "sm_scale": HEAD_DIM ** -0.5,
        "tree_mask": _chain_trees(B, D, device) if kind == "tree" else None, "max_kv_len": CONTEXT})
    what = (f"{B} requests x {q_len} queries over {CONTEXT} tokens, {QUERY_HEADS} query / {HEADS} KV heads x "
            f"{HEAD_DIM}, {str(dtype).removeprefix('torch.')}")
    return call, what


def _mean_ms(runtime, fn) -> float:
    """Mean milliseconds of ``fn()`` over ``REPEATS`` calls between two synchronizations."""
    runtime.synchronize()
    start = time.perf_counter()
    for _ in range(REPEATS):
        fn()
    runtime.synchronize()
    return (time.perf_counter() - start) / REPEATS * 1e3


def _measure(backend, fn, record_property) -> None:
    """Record ``eager_ms`` and, where the runtime captures graphs, ``graph_ms`` (or ``graph_error``)."""
    runtime = backend.runtime
    fn()
    record_property("eager_ms", round(_mean_ms(runtime, fn), 4))
    record_property("repeats", REPEATS)
    if not runtime.graph_capture:
        return
    try:
        graph = runtime.new_graph()
        with runtime.capture(graph):
            fn()
    except Exception as exc:  # a vendor op that cannot be captured is a finding, not a failure
        record_property("graph_error", f"{type(exc).__name__}: {exc}"[:300])
        return
    graph.replay()
    record_property("graph_ms", round(_mean_ms(runtime, graph.replay), 4))


# Every op; attention, whose cost depends on the kind of step, has a test of its own below.
TIMED_OPS = tuple(op for op in OPS if op != "attention")


@conformance(tier="performance")
@pytest.mark.parametrize("op", [pytest.param(op, marks=conformance(op=op)) for op in TIMED_OPS])
def test_op_time(unchecked_backend, device, record_property, op):
    call, what = _workload(op, unchecked_backend, device)
    record_property("workload", what)
    _measure(unchecked_backend, lambda: call.run(unchecked_backend), record_property)


@conformance(op="attention", tier="performance")
@pytest.mark.parametrize("kind", ["decode", "tree"])
def test_attention_time(unchecked_backend, device, record_property, kind):
    """One layer's call with the batch's layout built beforehand (``eager_ms``, ``graph_ms``), and
    the layout itself, built once per forward (``layout_ms``)."""
    call, what = _attention_workload(kind, unchecked_backend, device)
    a = call.args
    record_property("workload", what)

    def build():
        return unchecked_backend.attention_layout(a["req_to_token"], a["req_pool_indices"], a["kv_lens"],
                                                  a["q_lens"], a["q"].shape[0], a["tree_mask"], a["max_kv_len"])

    build()
    record_property("layout_ms", round(_mean_ms(unchecked_backend.runtime, build), 4))
    layer = call.replace(layout=build())
    _measure(unchecked_backend, lambda: layer.run(unchecked_backend), record_property)

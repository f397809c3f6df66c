"""Performance tier: the time of one call of each op at sizes that mean something on a GPU
(a decode step of 64 requests with 8-node trees, a 30-layer cache, attention over a few thousand
tokens), recorded as report properties and shown in the matrix. Measured, never pass/fail. Each
op's timed call is registered beside its tests (``cases.timed_call``); attention's are here.

Each op runs once to warm up, then ``REPEATS`` times between two ``synchronize()`` calls (once on
a proxy, whose times are not the device's): ``eager_ms`` is the mean. Where
``backend.runtime.graph_capture`` is true the same call is captured into a graph and replayed the
same way: ``graph_ms`` (``graph_error`` when the op cannot be captured, e.g. because it reads
device data on the host). The backend is the ``unchecked_backend`` (``strict=False``): strict
value checks would time host syncs.
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
ATTENTION_BATCH, QUERY_HEADS = 4, 16


def _attention_workload(kind: str, backend, device) -> tuple[cases.Call, str]:
    """A decode step (one query each) or a tree verify (D nodes each) of a few requests of
    ``cases.TIMED_CONTEXT`` tokens; one layer's call."""
    B, D, dtype = ATTENTION_BATCH, cases.TIMED_NODES, cases.kv_half_dtype(backend)
    context, heads, head_dim = cases.TIMED_CONTEXT, cases.TIMED_HEADS, cases.TIMED_HEAD_DIM
    q_len = 1 if kind == "decode" else D
    kv = cases.random_kv(random.Random(kind), device, 1, B * context, heads, head_dim, dtype)
    gen = torch.Generator().manual_seed(5)
    table = torch.randperm(B * context, generator=gen).view(B, context).to(device)
    chains = torch.ones(D, D, dtype=torch.bool, device=device).tril().expand(B, D, D).contiguous()
    call = cases.Call("attention", {
        "q": torch.randn(B * q_len, QUERY_HEADS, head_dim, generator=gen).to(dtype).to(device), "kv": kv, "layer": 0,
        "req_to_token": table, "req_pool_indices": torch.arange(B, dtype=torch.int64, device=device),
        "kv_lens": torch.full((B,), context, dtype=torch.int64, device=device),
        "q_lens": torch.full((B,), q_len, dtype=torch.int64, device=device), "sm_scale": head_dim ** -0.5,
        "tree_mask": chains if kind == "tree" else None, "max_kv_len": context})
    what = (f"{B} requests x {q_len} queries over {context} tokens, {QUERY_HEADS} query / {heads} KV heads x "
            f"{head_dim}, {str(dtype).removeprefix('torch.')}")
    return call, what


def _repeats(backend) -> int:
    """Timed calls of each op: ``REPEATS``, or one on a proxy."""
    return 1 if backend.proxy else REPEATS


def _mean_ms(backend, fn) -> float:
    """Mean milliseconds of ``fn()`` over :func:`_repeats` calls between two synchronizations."""
    runtime, repeats = backend.runtime, _repeats(backend)
    runtime.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    runtime.synchronize()
    return (time.perf_counter() - start) / repeats * 1e3


def _measure(backend, fn, record_property) -> None:
    """Record ``eager_ms`` and, where the runtime captures graphs, ``graph_ms`` (or ``graph_error``)."""
    runtime = backend.runtime
    fn()
    record_property("eager_ms", round(_mean_ms(backend, fn), 4))
    record_property("repeats", _repeats(backend))
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
    record_property("graph_ms", round(_mean_ms(backend, graph.replay), 4))


# Every op; attention, whose cost depends on the kind of step, has a test of its own below.
TIMED_OPS = tuple(op for op in OPS if op != "attention")


@conformance(tier="performance")
@pytest.mark.parametrize("op", [pytest.param(op, marks=conformance(op=op)) for op in TIMED_OPS])
def test_op_time(unchecked_backend, device, record_property, op):
    call, what = cases.timed(op, unchecked_backend, device)
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
    record_property("layout_ms", round(_mean_ms(unchecked_backend, build), 4))
    layer = call.replace(layout=build())
    _measure(unchecked_backend, lambda: layer.run(unchecked_backend), record_property)

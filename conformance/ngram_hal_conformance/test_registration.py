"""Registration tier: every op present and callable (or refused by name), capabilities honest,
runtime basics working, graph capture where the runtime offers it."""

from __future__ import annotations

import pytest
import torch

from ngram_hal.backend import OPS, Capabilities
from ngram_hal.contract import same_device

from . import cases

conformance = pytest.mark.conformance


@conformance(tier="registration")
@pytest.mark.parametrize("op", [pytest.param(op, marks=conformance(op=op)) for op in OPS])
def test_op_present(backend, device, op):
    """An op in capabilities().ops runs on a valid call; any other op raises
    NotImplementedError naming the op and the backend."""
    method = getattr(backend, op, None)
    assert callable(method), f"backend has no callable '{op}'"
    call = cases.minimal(op, device, backend)
    if op in backend.capabilities().ops:
        call.run(backend)
        backend.synchronize()
    else:
        with pytest.raises(NotImplementedError) as info:
            call.run(backend)
        message = str(info.value)
        assert op in message and backend.name in message, (
            f"NotImplementedError must name op '{op}' and backend '{backend.name}': {message!r}")


@conformance(tier="registration")
def test_capabilities(backend, device):
    """capabilities() is a Capabilities model describing this instance."""
    caps = backend.capabilities()
    assert isinstance(caps, Capabilities), f"capabilities() returned {type(caps).__name__}"
    assert caps.name and caps.name == backend.name
    assert len(set(caps.ops)) == len(caps.ops), f"ops listed twice: {caps.ops}"
    assert [op for op in OPS if op in caps.ops] == caps.ops, f"unknown ops or not in OPS order: {caps.ops}"
    assert same_device(torch.device(caps.device), device), f"capabilities device {caps.device} vs {device}"
    assert isinstance(caps.proxy, bool)
    assert caps.kv_dtypes and all(isinstance(getattr(torch, name, None), torch.dtype) for name in caps.kv_dtypes)
    assert caps.page_sizes is None or all(isinstance(p, int) and p >= 1 for p in caps.page_sizes)
    assert caps.warp_size is None or caps.warp_size >= 1
    assert Capabilities.model_validate_json(caps.model_dump_json()) == caps
    assert caps.batch_invariant or not backend.invariant_by_default(), (
        "invariant_by_default() is true where capabilities().batch_invariant says the mode does not hold: "
        "an engine's default numerics would be the unchecked ones")


@conformance(tier="registration")
def test_runtime(backend, device):
    """synchronize, streams, events and host buffers work on the backend's device."""
    rt = backend.runtime
    assert same_device(rt.device, device)
    assert backend.synchronize() is None
    stream = rt.new_stream()
    event = rt.new_event()
    with rt.stream(stream):
        x = torch.arange(8, dtype=torch.int64, device=device) * 2
        event.record()
    rt.current_stream().wait_event(event)
    event.synchronize()
    assert event.query() is True
    buf = rt.to_host(x)
    backend.synchronize()
    assert buf.device.type == "cpu" and buf.tolist() == list(range(0, 16, 2))
    host = rt.empty_host((4,), torch.int64)
    assert host.device.type == "cpu" and tuple(host.shape) == (4,)
    assert isinstance(rt.graph_capture, bool) and backend.capabilities().graph_capture == rt.graph_capture


@conformance(tier="registration")
def test_graph_capture(backend, device):
    """Where the runtime offers graph capture, work captured into a graph runs again on
    ``replay()`` with the inputs' new values; elsewhere ``new_graph()`` raises NotImplementedError."""
    rt = backend.runtime
    if not rt.graph_capture:
        with pytest.raises(NotImplementedError):
            rt.new_graph()
        return
    x = torch.arange(8, dtype=torch.int64, device=device)
    out = torch.zeros_like(x)
    graph = rt.new_graph()
    with rt.capture(graph):
        out.copy_(x * 3)
    x.add_(1)
    graph.replay()
    rt.synchronize()
    assert out.cpu().tolist() == [3 * (i + 1) for i in range(8)]

"""The generic runtime on the host: inert streams and events, host buffers, and no graph capture
(``new_graph``, ``new_graph_pool`` and ``capture`` refuse by name). Graph capture on a device is exercised by the
conformance suite's registration tier on that device."""

from __future__ import annotations

import os
import platform
from pathlib import Path

import pytest
import torch

from ngram_hal.reference import CpuBackend
from ngram_hal.runtime import Runtime


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_host_runtime_has_no_graph_capture(device):
    rt = Runtime(device)
    assert rt.is_host and not rt.graph_capture and not rt.has_pinned_memory
    with pytest.raises(NotImplementedError, match=f"graph capture is not available on {device}"):
        rt.new_graph()
    with pytest.raises(NotImplementedError, match=f"graph capture is not available on {device}"):
        rt.capture(None)
    with pytest.raises(NotImplementedError, match=f"graph capture is not available on {device}"):
        rt.new_graph_pool()
    assert CpuBackend(device=device).capabilities().graph_capture is False


def test_host_streams_and_events_complete_at_once():
    rt = Runtime("cpu")
    event, stream = rt.new_event(), rt.new_stream()
    with rt.stream(stream):
        x = torch.arange(4) + 1
        event.record(stream)
    rt.current_stream().wait_event(event)
    assert event.query() is True
    assert rt.to_host(x) is x
    out = rt.empty_host((4,), torch.int64)
    assert rt.to_host(x, out=out) is out and out.tolist() == [1, 2, 3, 4]


def test_hardware_names_the_host_processor():
    hw = Runtime("cpu").hardware()
    models = [line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
              if line.partition(":")[0].strip() == "model name"] if Path("/proc/cpuinfo").is_file() else []
    assert hw["name"] == (models[0] if models else platform.processor() or platform.machine())
    assert hw["architecture"] == platform.machine() and hw["runtime"] is None
    assert hw["memory_bytes"] > 2**30 and hw["multiprocessors"] == os.cpu_count()


def test_free_memory_is_unknown_on_the_host():
    """The host's free memory is no device figure: None, so memory checks are skipped there."""
    assert Runtime("cpu").free_memory() is None


def test_peak_memory_and_copy_bandwidth_on_the_host():
    """The host keeps no allocation peak (None, and resetting it does nothing); a copy's bandwidth
    is measured anywhere."""
    runtime = Runtime("cpu")
    runtime.reset_peak_memory()
    assert runtime.peak_memory() is None
    assert runtime.copy_bandwidth(1 << 20, repeats=3) > 0
    assert runtime.matmul_throughput(64, torch.float32, repeats=3) > 0

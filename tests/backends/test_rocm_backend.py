"""The ROCm backend's launch settings and runtime: wavefront-sized warps, AMD-only options only
where the kernels compile for AMD, and graph capture through torch's device module. Its kernels'
results are checked by the conformance suite on the proxy (`make test-proxy-rocm`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ngram_hal.kernels.triton.ops import TritonHalOps
from ngram_hal.runtime import Runtime
from ngram_hal_rocm import PROXY_ENV, RocmBackend, hip_launch, proxy_device


def test_cdna_wave64_with_mfma_option():
    cfg = hip_launch(SimpleNamespace(warp_size=64, gcnArchName="gfx942:sramecc+:xnack-"))
    assert (cfg.warp_size, cfg.max_num_warps) == (64, 16)
    assert dict(cfg.kernel_options) == {"waves_per_eu": 2, "matrix_instr_nonkdim": 16}
    # A program never exceeds a workgroup's 1024 lanes, whatever it asks for.
    assert [cfg.warps(t) for t in (1, 64, 65, 1024, 1 << 20)] == [1, 1, 2, 16, 16]
    assert cfg.attn_num_warps(128, 128) <= 16


def test_rdna_wave32_without_mfma_option():
    cfg = hip_launch(SimpleNamespace(warp_size=32, gcnArchName="gfx1100"))
    assert (cfg.warp_size, cfg.max_num_warps) == (32, 32)
    assert dict(cfg.kernel_options) == {"waves_per_eu": 2}


@pytest.mark.parametrize("arch, mfma", [("gfx90a:sramecc+:xnack-", True), ("gfx950", True), ("gfx908", True),
                                         ("gfx906", False), ("gfx1201", False)])
def test_mfma_option_only_where_the_architecture_has_mfma(arch, mfma):
    cfg = hip_launch(SimpleNamespace(warp_size=64, gcnArchName=arch))
    assert ("matrix_instr_nonkdim" in dict(cfg.kernel_options)) is mfma


def test_properties_without_a_wavefront_field_mean_cdna_width():
    assert hip_launch(SimpleNamespace()).warp_size == 64


@pytest.mark.skipif(torch.version.hip is not None, reason="a ROCm build always runs natively")
def test_interpreted_proxy_takes_no_amd_options(monkeypatch):
    monkeypatch.setenv(PROXY_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert proxy_device() == "cpu"
    backend = RocmBackend(strict=False)
    assert isinstance(backend, TritonHalOps) and backend.device.type == "cpu"
    cfg = backend.launch
    assert (cfg.warp_size, cfg.max_num_warps, cfg.kernel_options) == (64, 16, ())
    # Small batches split their keys too, so the proxy runs the decode path's merge kernel.
    assert (cfg.attn_programs, cfg.attn_min_split, cfg.attn_invariant_keys) == (64, 16, 16)
    assert type(backend).launch.attn_programs is None


def test_graphs_on_a_host_device_are_refused_by_name():
    rt = Runtime("cpu")
    assert rt.graph_capture is False
    with pytest.raises(NotImplementedError, match="graph capture is not available on cpu"):
        rt.new_graph()
    with pytest.raises(NotImplementedError, match="graph capture is not available on cpu"):
        rt.capture(None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA or ROCm device")
def test_graph_capture_replays_on_the_device():
    rt = Runtime("cuda")
    assert rt.graph_capture
    x = torch.zeros(4, device="cuda")
    graph = rt.new_graph()
    side = rt.new_stream()
    side.wait_stream(rt.current_stream())
    with rt.stream(side):
        x.add_(1)  # warm-up outside the capture
    rt.current_stream().wait_stream(side)
    with rt.capture(graph):
        x.add_(1)
    graph.replay()
    rt.synchronize()
    assert x.tolist() == [3.0] * 4

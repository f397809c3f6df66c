"""The vendor packages ngram-hal-cuda, -rocm and -npu: registration, every op present, honest availability."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata

import pytest
import torch

from ngram_hal import OPS, registry
from ngram_hal_cuda import PROXY_ENV as CUDA_PROXY_ENV
from ngram_hal_cuda import CudaBackend
from ngram_hal_npu import PROXY_ENV as NPU_PROXY_ENV
from ngram_hal_npu import NpuBackend
from ngram_hal_rocm import PROXY_ENV, RocmBackend

VENDORS = [
    # name, class, distribution, default device, warp size
    ("cuda", CudaBackend, "ngram-hal-cuda", "cuda", 32),
    ("rocm", RocmBackend, "ngram-hal-rocm", "cuda", 64),
    ("npu", NpuBackend, "ngram-hal-npu", "npu", None),
]
CPU_ONLY_TORCH = torch.version.cuda is None and torch.version.hip is None
HAS_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.fixture(autouse=True)
def no_proxy(monkeypatch):
    monkeypatch.delenv(PROXY_ENV, raising=False)
    monkeypatch.delenv(CUDA_PROXY_ENV, raising=False)
    monkeypatch.delenv(NPU_PROXY_ENV, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.mark.parametrize("name, cls, dist, device, warp", VENDORS)
def test_registered_by_entry_point(name, cls, dist, device, warp):
    (ep,) = [ep for ep in metadata.entry_points(group=registry.GROUP) if ep.name == name]
    assert ep.value == f"{cls.__module__.split('.')[0]}:{cls.__name__}"
    assert ep.dist.name == dist and ep.dist.version == "0.1.0"
    assert ep.load() is cls and registry.backend_class(name) is cls


@pytest.mark.parametrize("name, cls, dist, device, warp", VENDORS)
def test_every_op_and_capabilities(name, cls, dist, device, warp):
    assert cls.default_device == device
    assert cls.implemented_ops() == list(OPS)
    caps = cls(device="cpu").capabilities()
    assert (caps.name, caps.ops, caps.warp_size, caps.proxy, caps.graph_capture) == (name, list(OPS), warp, False, False)


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="checks the reasons given by a CPU-only build of torch")
def test_cuda_and_rocm_unavailable_with_reason_here():
    assert CudaBackend.is_available() == (
        False, f"torch {torch.__version__} is not a CUDA build; set {CUDA_PROXY_ENV}=1 for a proxy run")
    available, reason = RocmBackend.is_available()
    assert not available and reason.startswith(f"torch {torch.__version__} is not a ROCm build")
    assert PROXY_ENV in reason
    for name in ("cuda", "rocm"):
        with pytest.raises(RuntimeError, match=f"backend '{name}' is not available: torch"):
            registry.get_backend(name)


@pytest.mark.skipif(torch.version.cuda is None, reason="needs a CUDA build of torch")
def test_cuda_available_exactly_when_torch_sees_a_device():
    available, reason = CudaBackend.is_available()
    assert available == torch.cuda.is_available()
    assert reason == ("" if available else f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device")
    if available:
        backend = registry.get_backend("cuda")
        assert backend.device.type == "cuda" and backend.capabilities().graph_capture


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_unavailable_without_torch_npu():
    reason = f"torch_npu is not installed; set {NPU_PROXY_ENV}=1 for a proxy run on the CPU"
    assert NpuBackend.is_available() == (False, reason)
    with pytest.raises(RuntimeError, match=f"backend 'npu' is not available: {reason}"):
        registry.get_backend("npu")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_device_needs_torch_npu():
    with pytest.raises(ModuleNotFoundError, match="torch_npu"):
        NpuBackend()
    with pytest.raises(ModuleNotFoundError, match="torch_npu"):
        NpuBackend(device="npu:1")


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
def test_npu_proxy_on_cpu_tensors(monkeypatch):
    monkeypatch.setenv(NPU_PROXY_ENV, "1")
    assert NpuBackend.proxy is True
    assert NpuBackend.is_available() == (
        True, "proxy: torch_npu is not installed; the backend's torch ops run on CPU tensors")
    backend = registry.get_backend("npu")
    caps = backend.capabilities()
    assert (caps.device, caps.proxy, caps.ops, caps.graph_capture) == ("cpu", True, list(OPS), False)
    assert backend.runtime.is_host
    info = next(i for i in registry.list_backends() if i.name == "npu")
    assert (info.available, info.proxy, info.ops) == (True, True, list(OPS))
    monkeypatch.setenv(NPU_PROXY_ENV, "0")
    assert NpuBackend.proxy is False and not NpuBackend.is_available()[0]


@pytest.mark.skipif(HAS_TORCH_NPU, reason="torch_npu is installed here")
@pytest.mark.parametrize("error, message", [
    (ImportError, "libascendcl.so: cannot open shared object file: No such file or directory"),
    (OSError, "libhccl.so: cannot open shared object file"),
    (RuntimeError, "Ascend CANN toolkit not found; source set_env.sh"),
])
def test_npu_reports_the_import_error_of_torch_npu(tmp_path, monkeypatch, error, message):
    """torch_npu installed without CANN fails at import; that failure is the reason."""
    package = tmp_path / "torch_npu"
    package.mkdir()
    (package / "__init__.py").write_text(f"raise {error.__name__}({message!r})\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    available, reason = NpuBackend.is_available()
    assert (available, reason) == (False, f"torch_npu failed to import: {error.__name__}: {message}; "
                                          f"set {NPU_PROXY_ENV}=1 for a proxy run on the CPU")
    assert "torch_npu" not in sys.modules


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="needs a machine without a GPU")
def test_cuda_proxy_under_the_triton_interpreter(monkeypatch):
    monkeypatch.setenv(CUDA_PROXY_ENV, "1")
    if importlib.util.find_spec("triton") is None:
        assert CudaBackend.is_available() == (False, "proxy run requested but triton is not installed")
        return
    assert CudaBackend.is_available() == (
        False, "proxy run requested but TRITON_INTERPRET is not 1 and there is no CUDA device")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert CudaBackend.proxy is True
    assert CudaBackend.is_available() == (True, "proxy: no CUDA device; Triton kernels interpreted on the CPU")
    caps = registry.get_backend("cuda").capabilities()
    assert (caps.device, caps.proxy, caps.warp_size, caps.graph_capture) == ("cpu", True, 32, False)
    info = next(i for i in registry.list_backends() if i.name == "cuda")
    assert (info.available, info.proxy, info.ops) == (True, True, list(OPS))
    monkeypatch.setenv(CUDA_PROXY_ENV, "0")
    assert CudaBackend.proxy is False and not CudaBackend.is_available()[0]


def test_rocm_proxy_under_the_triton_interpreter(monkeypatch):
    if torch.version.hip is not None:
        pytest.skip("a ROCm build of torch always runs natively")
    if importlib.util.find_spec("triton") is None:
        monkeypatch.setenv(PROXY_ENV, "1")
        assert RocmBackend.is_available() == (False, "proxy run requested but triton is not installed")
        return
    monkeypatch.setenv(PROXY_ENV, "1")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert RocmBackend.proxy is True
    available, reason = RocmBackend.is_available()
    assert available and reason.startswith("proxy: no ROCm device")
    assert reason == "proxy: no ROCm device; Triton kernels interpreted on the CPU"
    backend = registry.get_backend("rocm")
    caps = backend.capabilities()
    assert (backend.device.type, caps.proxy, caps.ops, caps.warp_size) == ("cpu", True, list(OPS), 64)
    info = next(i for i in registry.list_backends() if i.name == "rocm")
    assert (info.available, info.proxy, info.ops) == (True, True, list(OPS))
    monkeypatch.setenv(PROXY_ENV, "0")
    assert RocmBackend.proxy is False and not RocmBackend.is_available()[0]


@pytest.mark.skipif(not CPU_ONLY_TORCH, reason="needs a machine without a GPU")
def test_rocm_proxy_needs_somewhere_to_run(monkeypatch):
    monkeypatch.setenv(PROXY_ENV, "1")
    available, reason = RocmBackend.is_available()
    assert not available
    assert reason in ("proxy run requested but TRITON_INTERPRET is not 1 and there is no CUDA device",
                      "proxy run requested but triton is not installed")


def test_vendor_modules_are_not_imported_with_ngram_hal():
    code = ("import json, sys, ngram_hal, ngram_hal.cli\n"
            "vendor = ('ngram_hal_cuda', 'ngram_hal_rocm', 'ngram_hal_npu', 'torch_npu')\n"
            "at_import = sorted(m for m in sys.modules if m.split('.')[0] in vendor)\n"
            "import ngram_hal_npu\n"
            "after_npu = sorted(m for m in sys.modules if m.split('.')[0] == 'torch_npu')\n"
            "print(json.dumps([at_import, after_npu]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == [[], []]

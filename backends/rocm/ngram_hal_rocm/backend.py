"""``RocmBackend``: AMD GPUs through a ROCm (HIP) build of torch.

ROCm torch exposes its GPUs under torch's ``cuda`` device type, so the default device is
``cuda``. No op is implemented yet (``capabilities().ops`` is empty); discovery already
reports honestly whether a ROCm device can be used here.

Proxy mode: with ``NGRAM_HAL_ROCM_PROXY=1`` and no ROCm build of torch, the backend's Triton
kernels are meant to run elsewhere, compiled for an NVIDIA GPU or interpreted on the CPU
(``TRITON_INTERPRET=1``). Such a run checks semantics, not AMD hardware, and reports
``proxy=True``. Proxy mode is opt-in so that auto-selection never prefers it to a native
backend.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from ngram_hal.backend import Backend

PROXY_ENV = "NGRAM_HAL_ROCM_PROXY"


def proxy_requested() -> bool:
    """True when ``NGRAM_HAL_ROCM_PROXY`` is set to a true value (1, true, yes, on)."""
    return os.environ.get(PROXY_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def proxy_device() -> str | None:
    """Where a proxy run executes: ``"cuda"`` on an NVIDIA GPU, ``"cpu"`` under
    ``TRITON_INTERPRET=1``, ``None`` when neither is possible."""
    if torch.version.cuda is not None and torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "cpu"
    return None


class _ProxyFlag:
    """``RocmBackend.proxy``, read at each access: a proxy run was requested and torch is not
    a ROCm build (on real ROCm hardware the run is always native)."""

    def __get__(self, obj, owner) -> bool:
        return torch.version.hip is None and proxy_requested()


class RocmBackend(Backend):
    """The ROCm backend: device ``cuda`` (torch's name for HIP devices), 64-lane wavefronts."""

    name = "rocm"
    default_device = "cuda"
    proxy = _ProxyFlag()
    warp_size = 64

    def __init__(self, device: torch.device | str | None = None, strict: bool | None = None):
        if device is None and type(self).proxy:
            device = proxy_device()
        super().__init__(device=device, strict=strict)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Native: a ROCm build of torch and a visible device. Proxy (opt-in): Triton and an
        NVIDIA GPU or ``TRITON_INTERPRET=1``; the reason then says it is a proxy."""
        if torch.version.hip is not None:
            if not torch.cuda.is_available():
                return False, f"torch {torch.__version__} (HIP {torch.version.hip}) sees no ROCm device"
            return True, ""
        if not proxy_requested():
            return False, (f"torch {torch.__version__} is not a ROCm build; "
                           f"set {PROXY_ENV}=1 for a proxy run")
        if importlib.util.find_spec("triton") is None:
            return False, "proxy run requested but triton is not installed"
        device = proxy_device()
        if device is None:
            return False, "proxy run requested but there is no CUDA device and TRITON_INTERPRET is not 1"
        where = "compiled for an NVIDIA GPU" if device == "cuda" else "interpreted on the CPU"
        return True, f"proxy: no ROCm device; Triton kernels {where}"

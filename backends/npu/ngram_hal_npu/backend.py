"""``NpuBackend``: Ascend NPUs through ``torch_npu``, every op in device-generic torch.

The ops (modules :mod:`.alloc`, :mod:`.kv`, :mod:`.tree`, :mod:`.verify`, :mod:`.attention`) use
only torch operations that ``torch_npu`` runs on the device, with shapes fixed by host ints so a
step can be captured in an NPU graph. Indices are int64 in and out, as the contract says; the
index operand of each gather and scatter is narrowed to int32 inside the op (:mod:`.indices`),
and a table too large for int32 indices is refused with ``ContractError``.

The runtime is the generic :class:`ngram_hal.runtime.Runtime` over ``torch.npu``: streams, events, pinned
host buffers and ``NPUGraph`` capture. ``torch_npu`` needs the CANN toolkit at import time, so it
is imported lazily: when availability is checked or a backend is created on an ``npu`` device,
never when ngram-hal or this package is imported.

Proxy mode: with ``NGRAM_HAL_NPU_PROXY=1`` and no usable NPU, the same code runs on CPU tensors
(device ``cpu``, the generic runtime's host behaviour). Such a run checks semantics, not Ascend
hardware, and reports ``proxy=True``.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ngram_hal.backend import Backend
from ngram_hal.proxy import ProxyFlag, requested

from .alloc import NpuAllocOps
from .attention import NpuAttentionOps
from .kv import NpuKvOps
from .tree import NpuTreeOps
from .verify import NpuVerifyOps

PROXY_ENV = "NGRAM_HAL_NPU_PROXY"


def npu_status() -> tuple[bool, str]:
    """``(True, "")`` when ``torch_npu`` imports (CANN present) and sees an NPU, else why not.
    Imports ``torch_npu`` when it is installed."""
    if importlib.util.find_spec("torch_npu") is None:
        return False, "torch_npu is not installed"
    try:
        importlib.import_module("torch_npu")
    except Exception as exc:  # without CANN the import raises ImportError, OSError or RuntimeError
        return False, f"torch_npu failed to import: {type(exc).__name__}: {exc}"
    npu = getattr(torch, "npu", None)
    if npu is None:
        return False, "torch_npu imported but registered no torch.npu module"
    if not npu.is_available():
        return False, "torch.npu.is_available() is False: no Ascend NPU visible"
    return True, ""


def _native() -> bool:
    return npu_status()[0]


class NpuBackend(NpuAllocOps, NpuKvOps, NpuTreeOps, NpuVerifyOps, NpuAttentionOps, Backend):
    """The Ascend backend: device ``npu``; ``cpu`` in a proxy run."""

    name = "npu"
    default_device = "npu"
    proxy = ProxyFlag(PROXY_ENV, _native)
    warp_size = None

    def __init__(self, device: torch.device | str | None = None, strict: bool | None = None):
        if device is None and type(self).proxy:
            device = "cpu"
        if str(device if device is not None else self.default_device).split(":")[0] == "npu":
            # torch knows the npu device type (and torch.npu) only once torch_npu is imported.
            importlib.import_module("torch_npu")
        super().__init__(device=device, strict=strict)

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Native: ``torch_npu`` importable and an NPU visible. Proxy (opt-in,
        ``NGRAM_HAL_NPU_PROXY=1``): always, on the CPU; the reason then says it is a proxy and why
        there is no NPU."""
        available, reason = npu_status()
        if available:
            return True, ""
        if requested(PROXY_ENV):
            return True, f"proxy: {reason}; the backend's torch ops run on CPU tensors"
        return False, f"{reason}; set {PROXY_ENV}=1 for a proxy run on the CPU"

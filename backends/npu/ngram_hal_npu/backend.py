"""``NpuBackend``: Ascend NPUs through ``torch_npu``.

No op is implemented yet (``capabilities().ops`` is empty); discovery already reports
honestly whether an NPU can be used here. ``torch_npu`` needs the CANN toolkit at import
time, so it is imported lazily, inside :meth:`NpuBackend.is_available`.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from ngram_hal.backend import Backend


class NpuBackend(Backend):
    """The Ascend backend: device ``npu``."""

    name = "npu"
    default_device = "npu"
    proxy = False
    warp_size = None

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        """Needs ``torch_npu`` installed and importable (CANN present) and a visible NPU."""
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

"""``CpuBackend``: every op in plain torch. It runs on any torch device (pass ``device=``)."""

from __future__ import annotations

import torch

from ..backend import Backend
from ..kernels.cpu import CpuLayerKernels
from .alloc import CpuAllocOps
from .attention import CpuAttentionOps
from .kv import CpuKvOps
from .tree import CpuTreeOps
from .verify import CpuVerifyOps


class CpuBackend(CpuAllocOps, CpuKvOps, CpuTreeOps, CpuVerifyOps, CpuAttentionOps, Backend):
    """The reference backend. Vectorized torch, no per-token Python loops, no host syncs.

    Each op group's module binds its functions as the ``_<op>`` of a mixin (``CpuKvOps`` in
    :mod:`~ngram_hal.reference.kv`, ...); each takes the op's validated arguments as they are.
    """

    name = "cpu"
    default_device = "cpu"
    proxy = False
    batch_invariant = True

    def layer_kernels(self, config, dtype, batch_invariant=False):
        """Plain torch, with float32 CPU projections in panels (:class:`~ngram_hal.kernels.cpu.CpuLayerKernels`).
        The batch-invariant mode needs float32 on the CPU: it runs every row count through the
        panels' compiled kernel."""
        if batch_invariant and (self.device.type != "cpu" or dtype != torch.float32):
            raise ValueError(f"the cpu backend's batch-invariant mode needs float32 on the CPU, "
                             f"not {dtype} on {self.device}")
        return CpuLayerKernels(config, self, dtype, batch_invariant)

    def invariance_holds(self) -> bool:
        """On the CPU only: its projections are the panels' compiled kernel (float32)."""
        return self.device.type == "cpu"

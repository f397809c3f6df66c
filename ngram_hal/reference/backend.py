"""``CpuBackend``: every op in plain torch. It runs on any torch device (pass ``device=``)."""

from __future__ import annotations

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

    def layer_kernels(self, config, dtype, batch_invariant=False):
        """Plain torch, with float32 CPU projections in panels (:class:`~ngram_hal.kernels.cpu.CpuLayerKernels`)."""
        if batch_invariant:
            return super().layer_kernels(config, dtype, batch_invariant)
        return CpuLayerKernels(config, self, dtype)

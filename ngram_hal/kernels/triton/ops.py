"""``TritonHalOps``: the HAL's ops through the portable Triton kernels, for any backend to mix in.

A backend class lists ``TritonHalOps`` before :class:`ngram_hal.Backend` and sets ``launch`` (its
:class:`LaunchConfig`). Each kernel module binds its wrappers as the ``_<op>`` of a mixin
(``TritonKvOps`` in :mod:`.kv`, ...), which forwards the validated arguments and ``launch``.
Importing this module imports Triton (a backend without it fails to load, naming ``triton``), and
Triton decides then whether to interpret the kernels (``TRITON_INTERPRET=1``), so set that
variable before a Triton backend is loaded.
"""

from __future__ import annotations

from typing import ClassVar

from .alloc import TritonAllocOps
from .attention import TritonAttentionOps
from .kv import TritonKvOps
from .launch import LaunchConfig, interpreting
from .tree import TritonTreeOps
from .verify import TritonVerifyOps


class TritonHalOps(TritonAllocOps, TritonKvOps, TritonTreeOps, TritonVerifyOps, TritonAttentionOps):
    """Mixin: every HAL op by the Triton kernels of :mod:`ngram_hal.kernels.triton`."""

    launch: ClassVar[LaunchConfig] = LaunchConfig()
    batch_invariant: ClassVar[bool] = True

    def invariance_holds(self) -> bool:
        """Not under Triton's interpreter, whose products are numpy's (the CPU's BLAS may sum a
        row in another order by its place in a tile); compiled kernels sum in one fixed order."""
        return not interpreting()

    def invariant_by_default(self) -> bool:
        """Wherever the mode holds: on an H100 its speculative runs commit plain decoding's tokens
        at 0.95-1.07x the other numerics' tok/s (docs/h200.md, "Exact by default")."""
        return self.invariance_holds()

    def layer_kernels(self, config, dtype, batch_invariant=False):
        """The fused Triton model kernels (:class:`~ngram_hal.kernels.gpu.layer_kernels.TritonLayerKernels`)."""
        from ..gpu.layer_kernels import TritonLayerKernels

        return TritonLayerKernels(config, self, dtype, batch_invariant)

    def lookup_kernel(self):
        """The Triton prompt lookup (:func:`~ngram_hal.kernels.gpu.lookup.record_and_draft`)."""
        from ..gpu.lookup import record_and_draft

        return record_and_draft

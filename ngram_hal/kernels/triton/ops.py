"""``TritonHalOps``: the HAL's ten ops through the portable Triton kernels, for any backend to mix in.

A backend class lists ``TritonHalOps`` before :class:`ngram_hal.Backend` and sets ``launch`` (its
:class:`LaunchConfig`); each ``_<op>`` then forwards the validated arguments to the kernel module's
wrapper of the same name, adding ``launch``. Kernel modules are imported on first use, so Triton
is imported only when an op runs.
"""

from __future__ import annotations

import importlib
from typing import ClassVar

from .launch import LaunchConfig


def _kernel_op(module: str, name: str):
    """A backend method ``_<name>(self, *args)`` calling ``<module>.<name>(*args, self.launch)``."""

    def op(self, *args):
        fn = getattr(importlib.import_module(f"{__package__}.{module}"), name)
        return fn(*args, self.launch)

    op.__name__ = op.__qualname__ = "_" + name
    op.__doc__ = f"``{name}`` by :func:`ngram_hal.kernels.triton.{module}.{name}`."
    return op


class TritonHalOps:
    """Mixin: every HAL op by the Triton kernels of :mod:`ngram_hal.kernels.triton`."""

    launch: ClassVar[LaunchConfig] = LaunchConfig()
    batch_invariant: ClassVar[bool] = True

    _alloc_extend = _kernel_op("alloc", "alloc_extend")
    _assign_req_to_token = _kernel_op("alloc", "assign_req_to_token")
    _gather_cache_locs = _kernel_op("alloc", "gather_cache_locs")
    _store_kv = _kernel_op("kv", "store_kv")
    _move_kv = _kernel_op("kv", "move_kv")
    _accepted_kv_moves = _kernel_op("kv", "accepted_kv_moves")
    _reconstruct_tree = _kernel_op("tree", "reconstruct_tree")
    _verify_tree_greedy = _kernel_op("verify", "verify_tree_greedy")
    _verify_tree_sample = _kernel_op("verify", "verify_tree_sample")
    _attention_layout = _kernel_op("attention", "attention_layout")
    _attention = _kernel_op("attention", "attention")

    def layer_kernels(self, config, dtype, batch_invariant=False):
        """The fused Triton model kernels (:class:`~ngram_hal.kernels.gpu.layer_kernels.TritonLayerKernels`)."""
        from ..gpu.layer_kernels import TritonLayerKernels

        return TritonLayerKernels(config, self, dtype, batch_invariant)

    def lookup_kernel(self):
        """The Triton prompt lookup (:func:`~ngram_hal.kernels.gpu.lookup.record_and_draft`)."""
        from ..gpu.lookup import record_and_draft

        return record_and_draft

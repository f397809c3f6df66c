"""``TritonHalOps``: the HAL's ten ops through the portable Triton kernels, for any backend to mix in.

A backend class lists ``TritonHalOps`` before :class:`ngram_hal.Backend` and sets ``launch`` (its
:class:`LaunchConfig`); each ``_<op>`` forwards the validated arguments to the kernel module's
wrapper of the same name, adding ``launch``. Each imports its kernel module when it first runs,
so Triton is imported only when an op runs.
"""

from __future__ import annotations

from typing import ClassVar

from .launch import LaunchConfig


class TritonHalOps:
    """Mixin: every HAL op by the Triton kernels of :mod:`ngram_hal.kernels.triton`."""

    launch: ClassVar[LaunchConfig] = LaunchConfig()
    batch_invariant: ClassVar[bool] = True

    def _alloc_extend(self, *args):
        from .alloc import alloc_extend
        return alloc_extend(*args, self.launch)

    def _assign_req_to_token(self, *args):
        from .alloc import assign_req_to_token
        return assign_req_to_token(*args, self.launch)

    def _gather_cache_locs(self, *args):
        from .alloc import gather_cache_locs
        return gather_cache_locs(*args, self.launch)

    def _store_kv(self, *args):
        from .kv import store_kv
        return store_kv(*args, self.launch)

    def _move_kv(self, *args):
        from .kv import move_kv
        return move_kv(*args, self.launch)

    def _accepted_kv_moves(self, *args):
        from .kv import accepted_kv_moves
        return accepted_kv_moves(*args, self.launch)

    def _reconstruct_tree(self, *args):
        from .tree import reconstruct_tree
        return reconstruct_tree(*args, self.launch)

    def _verify_tree_greedy(self, *args):
        from .verify import verify_tree_greedy
        return verify_tree_greedy(*args, self.launch)

    def _verify_tree_sample(self, *args):
        from .verify import verify_tree_sample
        return verify_tree_sample(*args, self.launch)

    def _attention_layout(self, *args):
        from .attention import attention_layout
        return attention_layout(*args, self.launch)

    def _attention(self, *args):
        from .attention import attention
        return attention(*args, self.launch)

    def layer_kernels(self, config, dtype, batch_invariant=False):
        """The fused Triton model kernels (:class:`~ngram_hal.kernels.gpu.layer_kernels.TritonLayerKernels`)."""
        from ..gpu.layer_kernels import TritonLayerKernels

        return TritonLayerKernels(config, self, dtype, batch_invariant)

    def lookup_kernel(self):
        """The Triton prompt lookup (:func:`~ngram_hal.kernels.gpu.lookup.record_and_draft`)."""
        from ..gpu.lookup import record_and_draft

        return record_and_draft

"""``CpuBackend``: every op in plain torch. It runs on any torch device (pass ``device=``)."""

from __future__ import annotations

from ..backend import Backend
from ..kernels.cpu import CpuLayerKernels
from . import alloc, attention, kv, tree, verify


class CpuBackend(Backend):
    """The reference backend. Vectorized torch, no per-token Python loops, no host syncs.

    Each ``_<op>`` is the reference module's function of the same name, which takes the op's
    validated arguments as they are; only attention adapts the layout object.
    """

    name = "cpu"
    default_device = "cpu"
    proxy = False

    _alloc_extend = staticmethod(alloc.alloc_extend)
    _assign_req_to_token = staticmethod(alloc.assign_req_to_token)
    _gather_cache_locs = staticmethod(alloc.gather_cache_locs)
    _store_kv = staticmethod(kv.store_kv)
    _move_kv = staticmethod(kv.move_kv)
    _accepted_kv_moves = staticmethod(kv.accepted_kv_moves)
    _reconstruct_tree = staticmethod(tree.reconstruct_tree)
    _verify_tree_greedy = staticmethod(verify.verify_tree_greedy)
    _verify_tree_sample = staticmethod(verify.verify_tree_sample)

    def layer_kernels(self, config, dtype, batch_invariant=False):
        """Plain torch, with float32 CPU projections in panels (:class:`~ngram_hal.kernels.cpu.CpuLayerKernels`)."""
        if batch_invariant:
            return super().layer_kernels(config, dtype, batch_invariant)
        return CpuLayerKernels(config, self, dtype)

    def _attention_layout(self, layout):
        return attention.layout(layout.req_to_token, layout.req_pool_indices, layout.kv_lens, layout.q_lens,
                                layout.tree_mask, layout.num_queries, layout.max_kv_len)

    def _attention(self, q, kv_cache, layer, layout, sm_scale):
        return attention.attention(q, kv_cache, layer, layout.plan, sm_scale)

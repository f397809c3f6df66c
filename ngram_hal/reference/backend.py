"""``CpuBackend``: every op in plain torch. It runs on any torch device (pass ``device=``)."""

from __future__ import annotations

from ..backend import Backend
from . import alloc, attention, kv, tree, verify


class CpuBackend(Backend):
    """The reference backend. Vectorized torch, no per-token Python loops, no host syncs."""

    name = "cpu"
    default_device = "cpu"
    proxy = False

    def _alloc_extend(self, prefix_lens, seq_lens, last_loc, free_pages, page_size, num_new_tokens):
        return alloc.alloc_extend(prefix_lens, seq_lens, last_loc, free_pages, page_size, num_new_tokens)

    def _assign_req_to_token(self, req_to_token, req_pool_indices, start, end, locs):
        alloc.assign_req_to_token(req_to_token, req_pool_indices, start, end, locs)

    def _gather_cache_locs(self, req_to_token, req_pool_indices, start, end, num_tokens):
        return alloc.gather_cache_locs(req_to_token, req_pool_indices, start, end, num_tokens)

    def _store_kv(self, kv_cache, layer, locs, k, v):
        kv.store_kv(kv_cache, layer, locs, k, v)

    def _move_kv(self, kv_cache, src, dst):
        kv.move_kv(kv_cache, src, dst)

    def _accepted_kv_moves(self, out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
        return kv.accepted_kv_moves(out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens)

    def _reconstruct_tree(self, tree_mask, seq_lens):
        return tree.reconstruct_tree(tree_mask, seq_lens)

    def _verify_tree_greedy(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_predict):
        return verify.verify_tree_greedy(candidates, retrieve_index, retrieve_next_token,
                                         retrieve_next_sibling, target_predict)

    def _verify_tree_sample(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_probs, uniform_samples, uniform_final):
        return verify.verify_tree_sample(candidates, retrieve_index, retrieve_next_token,
                                         retrieve_next_sibling, target_probs, uniform_samples, uniform_final)

    def _attention_layout(self, layout):
        return attention.layout(layout.req_to_token, layout.req_pool_indices, layout.kv_lens, layout.q_lens,
                                layout.tree_mask, layout.num_queries, layout.max_kv_len)

    def _attention(self, q, kv_cache, layer, layout, sm_scale):
        return attention.attention(q, kv_cache, layer, layout.plan, sm_scale)

"""``toy``: a third-party ngram-hal backend with four ops, written apart from the reference.

It keeps ``req_to_token`` and the KV cache as flat tables and works on flat row indices. The
ops it lacks are absent from ``capabilities()``, so calling them raises ``NotImplementedError``.
"""

from __future__ import annotations

import torch

from ngram_hal.backend import Backend

__all__ = ["ToyBackend"]


class ToyBackend(Backend):
    """assign_req_to_token, gather_cache_locs, store_kv and move_kv on float32 caches."""

    name = "toy"
    default_device = "cpu"
    kv_dtypes = (torch.float32,)

    @staticmethod
    def _flat_cells(req_to_token, req_pool_indices, start, end, n: int) -> torch.Tensor:
        """Flat indices into ``req_to_token.view(-1)`` of every cell ``[r_b, start_b:end_b]``."""
        lengths = end - start
        batch = torch.arange(lengths.shape[0], device=lengths.device)
        owner = torch.repeat_interleave(batch, lengths, output_size=n)
        first = torch.cumsum(lengths, 0) - lengths
        step = torch.arange(n, device=lengths.device) - first[owner]
        return req_pool_indices[owner] * req_to_token.shape[1] + start[owner] + step

    def _assign_req_to_token(self, req_to_token, req_pool_indices, start, end, locs):
        cells = self._flat_cells(req_to_token, req_pool_indices, start, end, locs.shape[0])
        req_to_token.view(-1).index_copy_(0, cells, locs)

    def _gather_cache_locs(self, req_to_token, req_pool_indices, start, end, num_tokens):
        cells = self._flat_cells(req_to_token, req_pool_indices, start, end, num_tokens)
        return req_to_token.view(-1).index_select(0, cells)

    def _store_kv(self, kv, layer, locs, k, v):
        rows = torch.where(locs == -1, kv.num_slots, locs)
        kv.k[layer, rows] = k
        kv.v[layer, rows] = v

    def _move_kv(self, kv, src, dst):
        live = (src != -1) & (dst != -1)
        src_rows = torch.where(live, src, kv.num_slots)
        dst_rows = torch.where(live, dst, kv.num_slots)
        for cache in (kv.k, kv.v):
            cache[:, dst_rows] = cache[:, src_rows]

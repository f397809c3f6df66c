"""Reference KV-cache ops: store rows, move rows, and the moves that compact accepted tree nodes.

Writes aimed at the -1 sentinel are redirected to the cache's scratch row ``S`` (see
:class:`ngram_hal.memory.KVCache`), so sentinels are skipped without reading data on the host.
Arguments are validated by :class:`ngram_hal.Backend` before these functions run. Values the
contract forbids (checked only in strict mode) are masked as a kernel would mask them: a slot
outside ``[0, S)`` is treated as the sentinel, and an accepted node or a ``req_to_token`` cell
out of range yields a ``(-1, -1)`` move, so no op reads or writes outside a tensor or stops
half-way.
"""

from __future__ import annotations

import torch

from ..contract import SENTINEL
from ..kv_cache import KVCache
from .ragged import within


def store_kv(kv: KVCache, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``kv.k[layer, locs[i]] = k[i]`` and the same for v; other locs land in the scratch row."""
    rows = torch.where(within(locs, kv.num_slots), locs, kv.num_slots)
    kv.k[layer].index_copy_(0, rows, k)
    kv.v[layer].index_copy_(0, rows, v)


def move_kv(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every layer, K and V: ``row[dst[i]] = row[src[i]]``, every source read before any write.

    The source rows of all layers are gathered into a new tensor before any row is written, which
    makes overlapping and cyclic move sets safe. Pairs with a side outside ``[0, S)`` (-1
    included) or with ``src == dst`` are sent to the scratch row.
    """
    scratch = kv.num_slots
    skip = ~within(src, scratch) | ~within(dst, scratch) | (src == dst)
    src_rows = torch.where(skip, scratch, src)
    dst_rows = torch.where(skip, scratch, dst)
    for cache in (kv.k, kv.v):
        cache.index_copy_(1, dst_rows, cache.index_select(1, src_rows))


def accepted_kv_moves(out_cache_loc: torch.Tensor, accept_index: torch.Tensor, req_to_token: torch.Tensor,
                      req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)``, int64[B*D]: entry ``b*D + j`` moves accepted node j of request b.

    ``src = out_cache_loc[accept_index[b, j]]`` and ``dst = req_to_token[r_b, seq_lens[b] + j]``
    for the entries of ``accept_index[b]`` before its first -1; -1 elsewhere.
    """
    B, D = accept_index.shape
    R, M = req_to_token.shape
    if B * D == 0 or R * M == 0:
        none = torch.full((B * D,), SENTINEL, dtype=torch.int64, device=accept_index.device)
        return none, none.clone()
    accepted = torch.cumprod(accept_index != SENTINEL, dim=1).bool()
    col = seq_lens.unsqueeze(1) + torch.arange(D, dtype=torch.int64, device=accept_index.device)
    live = accepted & within(accept_index, B * D) & within(req_pool_indices, R).unsqueeze(1) & within(col, M)
    node = torch.where(live, accept_index, 0).reshape(-1)
    src = torch.where(live, out_cache_loc.index_select(0, node).reshape(B, D), SENTINEL)
    cell = torch.where(live, req_pool_indices.unsqueeze(1) * M + col, 0).reshape(-1)
    dst = torch.where(live, req_to_token.view(-1).index_select(0, cell).reshape(B, D), SENTINEL)
    return src.reshape(-1), dst.reshape(-1)


class CpuKvOps:
    """Mixin: the reference's KV-cache ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _store_kv = staticmethod(store_kv)
    _move_kv = staticmethod(move_kv)
    _accepted_kv_moves = staticmethod(accepted_kv_moves)

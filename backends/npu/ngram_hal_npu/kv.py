"""KV-cache ops for Ascend: store rows, move rows, and the moves that compact accepted tree nodes.

K and V are addressed as flat row tables (``[L * (S + 1), H * d]``), so a move touches every layer
with one gather and one scatter per tensor, both with int32 row indices. Writes aimed at -1 land
in each layer's scratch row ``S``. Arguments were validated by :class:`ngram_hal.Backend`.
"""

from __future__ import annotations

import torch

from ngram_hal.contract import SENTINEL
from ngram_hal.kv_cache import KVCache

from .indices import fits_int32, narrow, take


def store_kv(kv: KVCache, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``kv.k[layer, locs[i]] = k[i]`` and the same for v; locs of -1 land in the scratch row."""
    rows = narrow("store_kv", "locs", torch.where(locs == SENTINEL, kv.num_slots, locs), kv.num_slots + 1)
    kv.k[layer].index_put_((rows,), k)
    kv.v[layer].index_put_((rows,), v)


def move_kv(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every layer, K and V: ``row[dst[i]] = row[src[i]]``, every source read before any write.

    The source rows of all layers are gathered into a new tensor before the scatter writes any
    row, so overlapping and cyclic move sets are safe. Pairs with -1 on either side or with
    ``src == dst`` move the scratch row onto itself.
    """
    op = "move_kv"
    L, rows_per_layer = kv.num_layers, kv.num_slots + 1
    fits_int32(op, "kv", L * rows_per_layer)
    skip = (src == SENTINEL) | (dst == SENTINEL) | (src == dst)
    layer_base = torch.arange(L, dtype=torch.int64, device=src.device).unsqueeze(1) * rows_per_layer
    src_rows = narrow(op, "src", layer_base + torch.where(skip, kv.num_slots, src), L * rows_per_layer)
    dst_rows = narrow(op, "dst", layer_base + torch.where(skip, kv.num_slots, dst), L * rows_per_layer)
    src_rows, dst_rows = src_rows.view(-1), dst_rows.view(-1)
    for cache in (kv.k, kv.v):
        table = cache.view(L * rows_per_layer, -1)
        table.index_put_((dst_rows,), table.index_select(0, src_rows))


def accepted_kv_moves(out_cache_loc: torch.Tensor, accept_index: torch.Tensor, req_to_token: torch.Tensor,
                      req_pool_indices: torch.Tensor, seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(src, dst)``, int64[B*D]: entry ``b*D + j`` moves accepted node j of request b.

    Request b's accepted entries are those of ``accept_index[b]`` before its first -1:
    ``src = out_cache_loc[accept_index[b, j]]``, ``dst = req_to_token[r_b, seq_lens[b] + j]``;
    every other entry is -1.
    """
    op = "accepted_kv_moves"
    B, D = accept_index.shape
    j = torch.arange(D, dtype=torch.int64, device=accept_index.device)
    first_gap = torch.where(accept_index == SENTINEL, j, D).amin(1, keepdim=True) if D else j.view(1, 0)
    accepted = j < first_gap
    src = take(op, "accept_index", out_cache_loc, torch.where(accepted, accept_index, 0))
    cell = (req_pool_indices * req_to_token.shape[1] + seq_lens).unsqueeze(1) + j
    dst = take(op, "seq_lens", req_to_token.view(-1), torch.where(accepted, cell, 0))
    return (torch.where(accepted, src, SENTINEL).reshape(-1),
            torch.where(accepted, dst, SENTINEL).reshape(-1))


class NpuKvOps:
    """Mixin: the NPU backend's KV-cache ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _store_kv = staticmethod(store_kv)
    _move_kv = staticmethod(move_kv)
    _accepted_kv_moves = staticmethod(accepted_kv_moves)

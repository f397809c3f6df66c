"""Reference KV-cache ops: store rows, move rows, and the moves that compact accepted tree nodes.

Writes aimed at the -1 sentinel are redirected to the cache's scratch row ``S`` (see
:class:`ngram_hal.memory.KVCache`), so sentinels are skipped without reading data on the host.
Arguments are validated by :class:`ngram_hal.Backend` before these functions run.
"""

from __future__ import annotations

import torch

from ..contract import SENTINEL
from ..memory.kv_cache import KVCache


def store_kv(kv: KVCache, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """``kv.k[layer, locs[i]] = k[i]`` and the same for v; locs of -1 land in the scratch row."""
    rows = torch.where(locs == SENTINEL, kv.num_slots, locs)
    kv.k[layer].index_copy_(0, rows, k)
    kv.v[layer].index_copy_(0, rows, v)


def move_kv(kv: KVCache, src: torch.Tensor, dst: torch.Tensor) -> None:
    """In every layer, K and V: ``row[dst[i]] = row[src[i]]``, every source read before any write.

    The source rows of all layers are gathered into a new tensor before any row is written, which
    makes overlapping and cyclic move sets safe. Pairs with -1 on either side or with
    ``src == dst`` are sent to the scratch row.
    """
    skip = (src == SENTINEL) | (dst == SENTINEL) | (src == dst)
    scratch = kv.num_slots
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
    accepted = torch.cumprod(accept_index != SENTINEL, dim=1).bool()
    node = torch.where(accepted, accept_index, 0).reshape(-1)
    src = torch.where(accepted, out_cache_loc.index_select(0, node).reshape(B, D), SENTINEL)
    j = torch.arange(D, dtype=torch.int64, device=accept_index.device)
    cell = (req_pool_indices * req_to_token.shape[1] + seq_lens).unsqueeze(1) + j
    cell = torch.where(accepted, cell, 0).reshape(-1)
    dst = torch.where(accepted, req_to_token.view(-1).index_select(0, cell).reshape(B, D), SENTINEL)
    return src.reshape(-1), dst.reshape(-1)

"""The ops of the allocation, cache-location and KV groups written out as plain Python loops.

Each function is the docstring in :mod:`ngram_hal.backend` read literally, one entry at a time,
on host lists (K/V on host tensors). The suite checks a backend against these as well as against
the reference backend, so a bug shared by both is still caught.
"""

from __future__ import annotations

import torch

SENTINEL = -1


def alloc_extend(prefix_lens: list[int], seq_lens: list[int], last_loc: list[int], free_pages: list[int],
                 page_size: int) -> list[int]:
    out, next_page = [], 0
    for prefix, seq, last in zip(prefix_lens, seq_lens, last_loc):
        slot = None
        for pos in range(prefix, seq):
            if pos % page_size == 0:
                slot = free_pages[next_page] * page_size
                next_page += 1
            elif slot is None:  # continue the last partial page of the prefix
                slot = last + 1
            else:
                slot += 1
            out.append(slot)
    return out


def assign_req_to_token(table: list[list[int]], req_pool_indices: list[int], start: list[int], end: list[int],
                        locs: list[int]) -> list[list[int]]:
    table = [row[:] for row in table]
    off = 0
    for r, a, b in zip(req_pool_indices, start, end):
        for col in range(a, b):
            table[r][col] = locs[off]
            off += 1
    return table


def gather_cache_locs(table: list[list[int]], req_pool_indices: list[int], start: list[int],
                      end: list[int]) -> list[int]:
    return [table[r][col] for r, a, b in zip(req_pool_indices, start, end) for col in range(a, b)]


def store_kv(cache: torch.Tensor, layer: int, locs: list[int], rows: torch.Tensor) -> torch.Tensor:
    """``cache`` [L, S(+1), H, d] (host) after writing ``rows[i]`` at ``locs[i]`` of ``layer``."""
    cache = cache.clone()
    for i, loc in enumerate(locs):
        if loc != SENTINEL:
            cache[layer, loc] = rows[i]
    return cache


def move_kv(cache: torch.Tensor, src: list[int], dst: list[int]) -> torch.Tensor:
    """``cache`` [L, S(+1), H, d] (host) after the moves, every source read from the old cache."""
    old, cache = cache, cache.clone()
    for s, d in zip(src, dst):
        if s != SENTINEL and d != SENTINEL:
            cache[:, d] = old[:, s]
    return cache


def accepted_kv_moves(out_cache_loc: list[int], accept_index: list[list[int]], table: list[list[int]],
                      req_pool_indices: list[int], seq_lens: list[int]) -> tuple[list[int], list[int]]:
    src, dst = [], []
    for b, nodes in enumerate(accept_index):
        accepted = True
        for j, node in enumerate(nodes):
            accepted = accepted and node != SENTINEL
            src.append(out_cache_loc[node] if accepted else SENTINEL)
            dst.append(table[req_pool_indices[b]][seq_lens[b] + j] if accepted else SENTINEL)
    return src, dst

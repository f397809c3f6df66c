"""``NumpyBackend``: eight of the HAL's ten ops written in NumPy over CPU tensors.

The tensors the HAL passes in share their memory with the NumPy views taken here
(``Tensor.numpy()``), so in-place ops write straight into the caller's tensors and outputs are
wrapped back with ``torch.from_numpy``. ``verify_tree_sample`` and ``attention`` are not
implemented: ``capabilities().ops`` leaves them out and calling them raises
``NotImplementedError``. NumPy has no bfloat16, so the KV cache may be float32 or float16.

Every argument reaching a ``_<op>`` method was validated by :class:`ngram_hal.Backend`: int64,
contiguous, on the CPU, with the documented shapes.
"""

from __future__ import annotations

import numpy as np
import torch

from ngram_hal import SENTINEL, Backend


def _out(a: np.ndarray) -> torch.Tensor:
    """A NumPy result as the int64 tensor the contract asks for."""
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


def _runs(lengths: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """For ``total`` items in runs of ``lengths``: each item's run and its place in the run."""
    run = np.repeat(np.arange(lengths.size), lengths)[:total]
    first = np.cumsum(lengths) - lengths
    return run, np.arange(run.size) - first[run]


def _cells(table: np.ndarray, rows: np.ndarray, start: np.ndarray, end: np.ndarray, total: int) -> np.ndarray:
    """Flat indices of ``table[rows[b], start[b]:end[b]]`` for every b, in order."""
    run, offset = _runs(end - start, total)
    return rows[run] * table.shape[1] + start[run] + offset


class NumpyBackend(Backend):
    """The ``numpy`` backend: CPU tensors, float32 and float16 KV caches."""

    name = "numpy"
    default_device = "cpu"
    kv_dtypes = (torch.float32, torch.float16)

    def _alloc_extend(self, prefix_lens, seq_lens, last_loc, free_pages, page_size, num_new_tokens):
        prefix, seq, last, free = prefix_lens.numpy(), seq_lens.numpy(), last_loc.numpy(), free_pages.numpy()
        run, offset = _runs(seq - prefix, num_new_tokens)
        pos = prefix[run] + offset
        fresh_from = -(-prefix // page_size)  # first page index the request starts fresh
        pages = -(-seq // page_size) - fresh_from
        first_page = np.cumsum(pages) - pages
        in_partial = pos // page_size < fresh_from[run]
        page_index = first_page[run] + pos // page_size - fresh_from[run]
        page = free[np.where(in_partial, 0, page_index)] if free.size else np.zeros_like(pos)
        fresh_slot = page * page_size + pos % page_size
        return _out(np.where(in_partial, last[run] + 1 + pos - prefix[run], fresh_slot))

    def _assign_req_to_token(self, req_to_token, req_pool_indices, start, end, locs):
        table = req_to_token.numpy()
        cells = _cells(table, req_pool_indices.numpy(), start.numpy(), end.numpy(), locs.shape[0])
        table.reshape(-1)[cells] = locs.numpy()

    def _gather_cache_locs(self, req_to_token, req_pool_indices, start, end, num_tokens):
        table = req_to_token.numpy()
        return _out(table.reshape(-1)[_cells(table, req_pool_indices.numpy(), start.numpy(), end.numpy(),
                                             num_tokens)])

    def _store_kv(self, kv, layer, locs, k, v):
        rows = np.where(locs.numpy() == SENTINEL, kv.num_slots, locs.numpy())
        kv.k.numpy()[layer, rows] = k.numpy()
        kv.v.numpy()[layer, rows] = v.numpy()

    def _move_kv(self, kv, src, dst):
        s, d = src.numpy(), dst.numpy()
        skip = (s == SENTINEL) | (d == SENTINEL) | (s == d)
        s, d = np.where(skip, kv.num_slots, s), np.where(skip, kv.num_slots, d)
        for cache in (kv.k.numpy(), kv.v.numpy()):
            cache[:, d] = cache[:, s]  # fancy indexing copies every source row before the write

    def _accepted_kv_moves(self, out_cache_loc, accept_index, req_to_token, req_pool_indices, seq_lens):
        index = accept_index.numpy()
        B, D = index.shape
        accepted = np.cumprod(index != SENTINEL, axis=1).astype(bool)
        src = np.where(accepted, out_cache_loc.numpy()[np.where(accepted, index, 0)], SENTINEL)
        table = req_to_token.numpy()
        cols = seq_lens.numpy()[:, None] + np.arange(D)
        rows = np.broadcast_to(req_pool_indices.numpy()[:, None], (B, D))
        dst = np.where(accepted, table[rows, np.where(accepted, cols, 0)], SENTINEL)
        return _out(src.reshape(-1)), _out(dst.reshape(-1))

    def _reconstruct_tree(self, tree_mask, seq_lens):
        mask = tree_mask.numpy()
        B, D, _ = mask.shape
        node = np.arange(D)
        positions = seq_lens.numpy()[:, None] + mask.sum(-1) - 1
        # In BFS order a node's deepest strict ancestor is its largest-index one.
        parent = np.where(mask & ~np.eye(D, dtype=bool), node, -1).max(-1, initial=-1)
        is_child = parent[:, None, :] == node[None, :, None]               # [b, p, i]
        first_child = np.where(is_child, node, D).min(-1, initial=D)
        later_sibling = (parent[:, :, None] == parent[:, None, :]) & (parent[:, :, None] >= 0) & (node > node[:, None])
        next_sibling = np.where(later_sibling, node, D).min(-1, initial=D)
        return (_out(positions.reshape(-1)), _out(np.arange(B * D).reshape(B, D)),
                _out(np.where(first_child < D, first_child, -1)), _out(np.where(next_sibling < D, next_sibling, -1)))

    def _verify_tree_greedy(self, candidates, retrieve_index, retrieve_next_token, retrieve_next_sibling,
                            target_predict):
        cand, index = candidates.numpy(), retrieve_index.numpy()
        first, sibling, target = retrieve_next_token.numpy(), retrieve_next_sibling.numpy(), target_predict.numpy()
        B, D = cand.shape
        batch = np.arange(B)
        path = np.full((B, D), -1)
        path[:, 0] = 0
        node, alive = np.zeros(B, dtype=np.int64), np.ones(B, dtype=bool)
        for depth in range(1, D):
            child, found = first[batch, node], np.full(B, -1)
            for _ in range(D - 1):  # along the sibling chain, first match wins
                hit = (child >= 0) & (found < 0) & (cand[batch, child.clip(0)] == target[batch, node])
                found = np.where(hit, child, found)
                child = np.where(child >= 0, sibling[batch, child.clip(0)], -1)
            alive &= found >= 0
            node = np.where(alive, found, node)
            path[:, depth] = np.where(alive, node, -1)
        accepted = path >= 0
        flat = np.where(accepted, index[batch[:, None], path.clip(0)], -1)
        predicts = np.zeros(B * D, dtype=np.int64)
        predicts[flat[accepted]] = target[batch[:, None], path.clip(0)][accepted]
        return _out(predicts), _out(flat), _out(accepted.sum(1))

"""Slot allocation and ``req_to_token`` cache locations for Ascend, in static-shape torch ops.

Every intermediate has a size fixed by host ints (the batch, ``num_new_tokens``, ``num_tokens``),
so the ops can be captured in an NPU graph. The table is addressed through its flat view with
int32 cell indices (:mod:`.indices`). Arguments were validated by :class:`ngram_hal.Backend`.
"""

from __future__ import annotations

import torch

from .indices import narrow, runs, take


def alloc_extend(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                 free_pages: torch.Tensor, page_size: int, num_new_tokens: int) -> torch.Tensor:
    """Slots for positions ``prefix_lens[b] .. seq_lens[b]-1``, request by request (see
    ``Backend.alloc_extend``): first the rest of the prefix's last partial page, then whole pages
    from the head of ``free_pages`` in request order. int64[num_new_tokens]."""
    op = "alloc_extend"
    run, offset = runs(op, seq_lens - prefix_lens, num_new_tokens)
    pos = take(op, "prefix_lens", prefix_lens, run) + offset
    # Pages a request starts fresh: from the page boundary at or after its prefix to its end.
    first_fresh = torch.div(prefix_lens + page_size - 1, page_size, rounding_mode="floor")
    fresh = torch.div(seq_lens + page_size - 1, page_size, rounding_mode="floor") - first_fresh
    page_base = torch.cumsum(fresh, 0) - fresh - first_fresh
    page_of_pos = torch.div(pos, page_size, rounding_mode="floor")
    in_partial = page_of_pos < take(op, "prefix_lens", first_fresh, run)
    continued = take(op, "last_loc", last_loc - prefix_lens + 1, run) + pos
    if free_pages.shape[0] == 0:
        return continued
    page_index = torch.where(in_partial, 0, take(op, "prefix_lens", page_base, run) + page_of_pos)
    page = take(op, "free_pages", free_pages, page_index)
    return torch.where(in_partial, continued, page * page_size + pos - page_of_pos * page_size)


def _cells(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
           end: torch.Tensor, total: int, op: str) -> torch.Tensor:
    """int32 flat cells of ``req_to_token[r_b, start_b:end_b]`` for every b, in request order."""
    run, offset = runs(op, end - start, total)
    row_start = req_pool_indices * req_to_token.shape[1] + start
    return narrow(op, "req_to_token", take(op, "req_pool_indices", row_start, run) + offset,
                  req_to_token.numel())


def assign_req_to_token(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                        end: torch.Tensor, locs: torch.Tensor) -> None:
    """In place: ``req_to_token[r_b, start_b:end_b] = locs[off_b : off_b + end_b - start_b]``."""
    cells = _cells(req_to_token, req_pool_indices, start, end, locs.shape[0], "assign_req_to_token")
    req_to_token.view(-1).index_put_((cells,), locs)


def gather_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                      end: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``req_to_token[r_b, start_b:end_b]`` for every request, concatenated: int64[num_tokens]."""
    cells = _cells(req_to_token, req_pool_indices, start, end, num_tokens, "gather_cache_locs")
    return req_to_token.view(-1).index_select(0, cells)


class NpuAllocOps:
    """Mixin: the NPU backend's allocation and cache-location ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _alloc_extend = staticmethod(alloc_extend)
    _assign_req_to_token = staticmethod(assign_req_to_token)
    _gather_cache_locs = staticmethod(gather_cache_locs)

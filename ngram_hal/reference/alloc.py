"""Reference slot allocation and ``req_to_token`` cache-location ops.

Vectorized, device-generic torch. Ragged per-request work is flattened over a host int the
caller already knows (:mod:`ngram_hal.reference.ragged`), so nothing reads device data back to
the host. Arguments are validated by :class:`ngram_hal.Backend` before these functions run; the
semantics are the docstrings there. Values the contract forbids (checked only in strict mode)
are masked as a kernel would mask them: no read or write outside a tensor, never a partly
written output. A slot that cannot be computed is -1, a cell outside ``req_to_token`` (a row
or column out of range, a negative run) is neither read (-1) nor written, and items past
``sum(end - start)`` or past the given count are dropped.
"""

from __future__ import annotations

import torch

from ..contract import SENTINEL
from .ragged import flatten, within


def _cells(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
           end: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat indices into ``req_to_token`` of ``[r_b, start_b:end_b]`` for every b, in order, and
    which of them lie inside the table (elsewhere the index is 0)."""
    R, M = req_to_token.shape
    flat = flatten(end - start, total)
    # Item i of run b is cell (r_b * M + start_b - first_b) + i. Its column lies in [0, M) for
    # first_b - start_b <= i < first_b - start_b + M; no item is inside a row out of range, nor
    # an item of no run (the fill gives it the empty range [0, 0)).
    lo = flat.first[:-1] - start
    row_ok = within(req_pool_indices, R)
    per_run = torch.stack([req_pool_indices * M - lo, torch.where(row_ok, lo, total), torch.where(row_ok, lo + M, 0)], 1)
    base, low, high = flat.per_run(per_run).unbind(1)
    ok = (flat.index >= low) & (flat.index < high)
    return torch.where(ok, base + flat.index, 0), ok


def _ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + (b - 1), b, rounding_mode="floor")


def alloc_extend(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                 free_pages: torch.Tensor, page_size: int, num_new_tokens: int) -> torch.Tensor:
    """Slots for positions ``prefix_lens[b] .. seq_lens[b]-1`` of each request, request by request.

    Positions inside the request's last partial page continue from ``last_loc[b] + 1``; the rest
    go to whole pages taken from the head of ``free_pages`` in request order, position ``p``
    landing at offset ``p % page_size`` of its page. int64[num_new_tokens]; -1 for a position
    that has no slot (no free page left, no ``last_loc`` for a partial page, or past the runs).
    """
    ps, P = page_size, free_pages.shape[0]
    prefix = prefix_lens.clamp(min=0)
    seq = torch.maximum(seq_lens, prefix)
    flat = flatten(seq - prefix, num_new_tokens)
    pos = flat.per_run(prefix) + flat.offset
    # The first position of a new page; positions below it fill the prefix's last partial page.
    boundary = _ceil_div(prefix, ps) * ps
    in_partial = pos < flat.per_run(boundary)
    partial_slot = flat.per_run(last_loc + 1 - prefix) + pos
    partial_ok = flat.per_run(last_loc, fill=SENTINEL) >= 0
    new_pages = _ceil_div(seq, ps) - boundary // ps
    first_page = torch.cumsum(new_pages, 0) - new_pages
    # Position p of request b uses free page first_page_b + (p - boundary_b) // page_size.
    page_idx = flat.per_run(first_page - boundary // ps) + torch.div(pos, ps, rounding_mode="floor")
    if P == 0:
        page, page_ok = page_idx, torch.zeros_like(in_partial)
    else:
        page = free_pages.index_select(0, page_idx.clamp(0, P - 1))
        page_ok = within(page_idx, P) & (page >= 0)
    slot = torch.where(in_partial, partial_slot, page * ps + pos % ps)
    ok = flat.inside & torch.where(in_partial, partial_ok, page_ok)
    return torch.where(ok, slot, SENTINEL)


def assign_req_to_token(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                        end: torch.Tensor, locs: torch.Tensor) -> None:
    """In place: ``req_to_token[r_b, start_b:end_b] = locs[off_b : off_b + end_b - start_b]``.

    A masked item repeats the write of the first kept item (the same cell, the same value), or
    writes cell 0 its own value when no item is kept, so it changes nothing.
    """
    N = locs.shape[0]
    if N == 0 or req_to_token.numel() == 0:
        return
    cells, ok = _cells(req_to_token, req_pool_indices, start, end, N)
    table = req_to_token.view(-1)
    first = ok.to(torch.uint8).argmax().view(1)
    some = ok.index_select(0, first)  # argmax gives 0 when no item is kept
    spare_cell = torch.where(some, cells.index_select(0, first), 0)
    spare_value = torch.where(some, locs.index_select(0, first), table[:1])
    table.index_copy_(0, torch.where(ok, cells, spare_cell), torch.where(ok, locs, spare_value))


def gather_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                      end: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``req_to_token[r_b, start_b:end_b]`` for every request, concatenated: int64[num_tokens]."""
    if req_to_token.numel() == 0:
        return torch.full((num_tokens,), SENTINEL, dtype=req_to_token.dtype, device=req_to_token.device)
    cells, ok = _cells(req_to_token, req_pool_indices, start, end, num_tokens)
    return torch.where(ok, req_to_token.view(-1).index_select(0, cells), SENTINEL)


class CpuAllocOps:
    """Mixin: the reference's allocation and cache-location ops, bound as the ``_<op>`` of :class:`~ngram_hal.backend.Backend`
    (which has validated their arguments)."""

    _alloc_extend = staticmethod(alloc_extend)
    _assign_req_to_token = staticmethod(assign_req_to_token)
    _gather_cache_locs = staticmethod(gather_cache_locs)

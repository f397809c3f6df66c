"""Reference slot allocation and ``req_to_token`` cache-location ops.

Vectorized, device-generic torch. Ragged per-request work is flattened with
``repeat_interleave(..., output_size=N)`` where ``N`` is a host int the caller already knows, so
nothing reads device data back to the host. Arguments are validated by :class:`ngram_hal.Backend`
before these functions run; the semantics are the docstrings there.
"""

from __future__ import annotations

import torch


def _ragged(lengths: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flatten ``B`` runs of ``lengths[b]`` items into ``total`` items.

    Returns ``(owner, starts)``: int64[total], the run each item belongs to, and int64[B], the
    flat index of each run's first item (the exclusive running sum of ``lengths``).
    """
    runs = torch.arange(lengths.shape[0], dtype=torch.int64, device=lengths.device)
    owner = torch.repeat_interleave(runs, lengths, output_size=total)
    return owner, torch.cumsum(lengths, 0) - lengths


def _flat_cells(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                end: torch.Tensor, total: int) -> torch.Tensor:
    """Flat indices into ``req_to_token`` of ``[r_b, start_b:end_b]`` for every b, in order."""
    owner, starts = _ragged(end - start, total)
    # Item i of run b sits at column start_b + (i - starts_b) of row r_b.
    base = req_pool_indices * req_to_token.shape[1] + start - starts
    return base.index_select(0, owner) + torch.arange(total, dtype=torch.int64, device=owner.device)


def _ceil_div(a: torch.Tensor, b: int) -> torch.Tensor:
    return torch.div(a + (b - 1), b, rounding_mode="floor")


def alloc_extend(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                 free_pages: torch.Tensor, page_size: int, num_new_tokens: int) -> torch.Tensor:
    """Slots for positions ``prefix_lens[b] .. seq_lens[b]-1`` of each request, request by request.

    Positions inside the request's last partial page continue from ``last_loc[b] + 1``; the rest
    go to whole pages taken from the head of ``free_pages`` in request order, position ``p``
    landing at offset ``p % page_size`` of its page. int64[num_new_tokens].
    """
    owner, starts = _ragged(seq_lens - prefix_lens, num_new_tokens)
    item = torch.arange(num_new_tokens, dtype=torch.int64, device=owner.device)
    pos = (prefix_lens - starts)[owner] + item
    # The first position of a new page; positions below it fill the prefix's last partial page.
    boundary = _ceil_div(prefix_lens, page_size) * page_size
    in_partial = pos < boundary[owner]
    partial_slot = (last_loc + 1 - prefix_lens)[owner] + pos
    if free_pages.shape[0] == 0:
        return partial_slot
    new_pages = _ceil_div(seq_lens, page_size) - boundary // page_size
    first_page = torch.cumsum(new_pages, 0) - new_pages
    # Position p of request b uses free page first_page_b + (p - boundary_b) // page_size.
    page_idx = (first_page - boundary // page_size)[owner] + torch.div(pos, page_size, rounding_mode="floor")
    page = free_pages[torch.where(in_partial, 0, page_idx)]
    return torch.where(in_partial, partial_slot, page * page_size + pos % page_size)


def assign_req_to_token(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                        end: torch.Tensor, locs: torch.Tensor) -> None:
    """In place: ``req_to_token[r_b, start_b:end_b] = locs[off_b : off_b + end_b - start_b]``."""
    cells = _flat_cells(req_to_token, req_pool_indices, start, end, locs.shape[0])
    req_to_token.view(-1).index_copy_(0, cells, locs)


def gather_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                      end: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """``req_to_token[r_b, start_b:end_b]`` for every request, concatenated: int64[num_tokens]."""
    cells = _flat_cells(req_to_token, req_pool_indices, start, end, num_tokens)
    return req_to_token.view(-1).index_select(0, cells)

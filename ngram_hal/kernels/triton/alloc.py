"""Slot allocation and ``req_to_token`` cache-location ops: one launch each, one program per request.

Request b's output (or its share of ``locs``) starts at the running sum of the lengths of the
requests before it. Each program adds those lengths itself, in blocks of ``BLOCK_B`` requests,
so no prefix-sum launch precedes the kernel; then it walks its own range in blocks of ``BLOCK_T``.
Both blocks are the launch configuration's ``index_block`` and the kernels' integer arguments are
not specialised, so each kernel compiles once whatever the batch (serving would otherwise compile
new variants while it runs).

Default-mode robustness (values the contract forbids but only strict mode checks): a negative
length counts as empty, a length is capped at the output size, and every load and store is
masked by the bounds of the tensor it touches. A table cell or free-list entry outside its
tensor reads as -1; a write outside the table is dropped. The last program fills any output
entry past the requests' total with -1.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import LaunchConfig

I64 = torch.int64


@triton.jit
def _lengths_before(lo_ptr, hi_ptr, b, cap, BLOCK_B: tl.constexpr):
    """sum over requests j < b of ``min(max(hi[j] - lo[j], 0), cap)``."""
    offs = tl.arange(0, BLOCK_B)
    acc = tl.zeros([BLOCK_B], dtype=tl.int64)
    for j0 in range(0, b, BLOCK_B):
        j = j0 + offs
        m = j < b
        lo = tl.load(lo_ptr + j, mask=m, other=0)
        hi = tl.load(hi_ptr + j, mask=m, other=0)
        acc += tl.minimum(tl.maximum(hi - lo, 0), cap)
    return tl.sum(acc, axis=0)


@triton.jit
def _fill_tail(out_ptr, b, B, end, num_out, BLOCK_T: tl.constexpr):
    """The last request's program writes -1 to ``out[end:num_out]`` (empty for valid inputs)."""
    lo = tl.where(b == B - 1, tl.maximum(end, 0), num_out)
    offs = tl.arange(0, BLOCK_T)
    for t0 in range(lo, num_out, BLOCK_T):
        t = t0 + offs
        tl.store(out_ptr + t, tl.full([BLOCK_T], -1, tl.int64), mask=t < num_out)


@triton.jit(do_not_specialize=["B", "num_free", "num_out", "page_size"])
def alloc_extend_kernel(prefix_ptr, seq_ptr, last_ptr, free_ptr, out_ptr, B, num_free, num_out, page_size,
                         BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    # Tokens and new pages of the requests before b: where b's slots and pages start.
    offs = tl.arange(0, BLOCK_B)
    tokens = tl.zeros([BLOCK_B], dtype=tl.int64)
    pages = tl.zeros([BLOCK_B], dtype=tl.int64)
    for j0 in range(0, b, BLOCK_B):
        j = j0 + offs
        m = j < b
        p = tl.maximum(tl.load(prefix_ptr + j, mask=m, other=0), 0)
        n = tl.minimum(tl.maximum(tl.load(seq_ptr + j, mask=m, other=0) - p, 0), num_out)
        tokens += n
        pages += tl.cdiv(p + n, page_size) - tl.cdiv(p, page_size)
    off = tl.sum(tokens, axis=0)
    first_page = tl.sum(pages, axis=0)

    p = tl.maximum(tl.load(prefix_ptr + b), 0)
    n_all = tl.minimum(tl.maximum(tl.load(seq_ptr + b) - p, 0), num_out)
    last = tl.load(last_ptr + b)
    # Positions below `boundary` continue the prefix's last partial page.
    boundary = tl.cdiv(p, page_size) * page_size
    n = tl.minimum(n_all, tl.maximum(num_out - off, 0))
    t_offs = tl.arange(0, BLOCK_T)
    for t0 in range(0, n, BLOCK_T):
        t = t0 + t_offs
        m = t < n
        pos = p + t
        in_partial = pos < boundary
        page_idx = first_page + (pos - boundary) // page_size
        page_ok = m & (pos >= boundary) & (page_idx >= 0) & (page_idx < num_free)
        page = tl.load(free_ptr + page_idx, mask=page_ok, other=-1)
        slot = tl.where(in_partial, last + 1 + t, tl.where(page_ok, page * page_size + pos % page_size, -1))
        tl.store(out_ptr + off + t, slot, mask=m)
    _fill_tail(out_ptr, b, B, off + n_all, num_out, BLOCK_T)


@triton.jit(do_not_specialize=["num_rows", "row_len", "num_locs"])
def assign_req_to_token_kernel(table_ptr, rows_ptr, start_ptr, end_ptr, locs_ptr, num_rows, row_len, num_locs,
                                BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    off = _lengths_before(start_ptr, end_ptr, b, num_locs, BLOCK_B)
    r = tl.load(rows_ptr + b)
    lo = tl.load(start_ptr + b)
    n = tl.minimum(tl.minimum(tl.maximum(tl.load(end_ptr + b) - lo, 0), num_locs), tl.maximum(num_locs - off, 0))
    cols = tl.where((r >= 0) & (r < num_rows), row_len, 0)  # no column of a row outside the table
    t_offs = tl.arange(0, BLOCK_T)
    for t0 in range(0, n, BLOCK_T):
        t = t0 + t_offs
        col = lo + t
        m = (t < n) & (col >= 0) & (col < cols)
        loc = tl.load(locs_ptr + off + t, mask=m)
        tl.store(table_ptr + r * row_len + col, loc, mask=m)


@triton.jit(do_not_specialize=["B", "num_rows", "row_len", "num_out"])
def gather_cache_locs_kernel(table_ptr, rows_ptr, start_ptr, end_ptr, out_ptr, B, num_rows, row_len, num_out,
                              BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    off = _lengths_before(start_ptr, end_ptr, b, num_out, BLOCK_B)
    r = tl.load(rows_ptr + b)
    lo = tl.load(start_ptr + b)
    n_all = tl.minimum(tl.maximum(tl.load(end_ptr + b) - lo, 0), num_out)
    n = tl.minimum(n_all, tl.maximum(num_out - off, 0))
    cols = tl.where((r >= 0) & (r < num_rows), row_len, 0)  # no column of a row outside the table
    t_offs = tl.arange(0, BLOCK_T)
    for t0 in range(0, n, BLOCK_T):
        t = t0 + t_offs
        col = lo + t
        m = t < n
        loc = tl.load(table_ptr + r * row_len + col, mask=m & (col >= 0) & (col < cols), other=-1)
        tl.store(out_ptr + off + t, loc, mask=m)
    _fill_tail(out_ptr, b, B, off + n_all, num_out, BLOCK_T)


def _output(size: int, batch: int, device: torch.device) -> tuple[torch.Tensor, bool]:
    """A new int64[size] output and whether a kernel must fill it: not when it is empty, nor when
    there is no request (then it holds -1 only)."""
    out = torch.empty(size, dtype=I64, device=device)
    if size and not batch:
        out.fill_(-1)
    return out, bool(size and batch)


def alloc_extend(prefix_lens: torch.Tensor, seq_lens: torch.Tensor, last_loc: torch.Tensor,
                 free_pages: torch.Tensor, page_size: int, num_new_tokens: int, cfg: LaunchConfig) -> torch.Tensor:
    """Slots for extending B requests from ``prefix_lens`` to ``seq_lens`` (one launch).

    Args:
        prefix_lens, seq_lens, last_loc: int64[B], contiguous. free_pages: int64[P], contiguous.
        page_size: host int >= 1. num_new_tokens: host int, ``sum(seq_lens - prefix_lens)``.
        cfg: the backend's launch configuration.
    Returns:
        int64[num_new_tokens] on the inputs' device: request b's positions ``prefix_lens[b] ..
        seq_lens[b]-1`` first fill the last partial page (``last_loc[b]+1, ...``), then whole pages
        from the head of ``free_pages``, requests in order.
    """
    B = prefix_lens.shape[0]
    out, launch = _output(num_new_tokens, B, prefix_lens.device)
    if launch:
        alloc_extend_kernel[(B,)](prefix_lens, seq_lens, last_loc, free_pages, out, B, free_pages.shape[0],
                                   num_new_tokens, page_size, BLOCK_B=cfg.index_block, BLOCK_T=cfg.index_block,
                                   num_warps=cfg.num_warps, **cfg.options())
    return out


def assign_req_to_token(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                        end: torch.Tensor, locs: torch.Tensor, cfg: LaunchConfig) -> None:
    """In place: ``req_to_token[r_b, start_b:end_b] = locs[off_b : off_b + end_b - start_b]`` (one launch).

    Args:
        req_to_token: int64[R, M], contiguous. req_pool_indices, start, end: int64[B].
        locs: int64[N], ``N = sum(end - start)``; ``off`` is the running sum.
        cfg: the backend's launch configuration.
    """
    B, N = req_pool_indices.shape[0], locs.shape[0]
    if B == 0 or N == 0:
        return
    R, M = req_to_token.shape
    assign_req_to_token_kernel[(B,)](req_to_token, req_pool_indices, start, end, locs, R, M, N,
                                      BLOCK_B=cfg.index_block, BLOCK_T=cfg.index_block, num_warps=cfg.num_warps,
                                      **cfg.options())


def gather_cache_locs(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, start: torch.Tensor,
                      end: torch.Tensor, num_tokens: int, cfg: LaunchConfig) -> torch.Tensor:
    """``req_to_token[r_b, start_b:end_b]`` for every request, concatenated (one launch).

    Args:
        req_to_token: int64[R, M], contiguous. req_pool_indices, start, end: int64[B].
        num_tokens: host int, ``sum(end - start)``. cfg: the backend's launch configuration.
    Returns:
        int64[num_tokens] on the table's device.
    """
    B = req_pool_indices.shape[0]
    out, launch = _output(num_tokens, B, req_to_token.device)
    if launch:
        R, M = req_to_token.shape
        gather_cache_locs_kernel[(B,)](req_to_token, req_pool_indices, start, end, out, B, R, M, num_tokens,
                                        BLOCK_B=cfg.index_block, BLOCK_T=cfg.index_block, num_warps=cfg.num_warps,
                                      **cfg.options())
    return out


class TritonAllocOps:
    """Mixin: the allocation and cache-location kernels as the ``_<op>`` of :class:`~ngram_hal.backend.Backend` (which
    has validated the arguments), launched with the backend's ``launch``."""

    def _alloc_extend(self, *args):
        return alloc_extend(*args, self.launch)

    def _assign_req_to_token(self, *args):
        return assign_req_to_token(*args, self.launch)

    def _gather_cache_locs(self, *args):
        return gather_cache_locs(*args, self.launch)

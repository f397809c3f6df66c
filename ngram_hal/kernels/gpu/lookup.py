"""Prompt lookup in one launch: record a step's committed tokens, then draft each request's chain.

One program per request: it writes the request's committed tokens into its row of the token
table, and after a barrier scans the row for the latest earlier occurrence of the longest suffix
(up to ``MAX_NGRAM`` tokens) and copies what followed it. The semantics, and the plain-torch
oracle, are :func:`ngram_hal.speculative.lookup.record_and_draft`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...contract import check_record_and_draft

SCAN_BLOCK = 512


@triton.jit(do_not_specialize=["W", "stride", "n"])
def lookup_kernel(table_ptr, rows_ptr, tokens_ptr, lens_ptr, seq_lens_ptr, live_ptr, out_ptr, match_ptr, W, stride,
                  n, MAX_NGRAM: tl.constexpr, MIN_NGRAM: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr, HAS_LIVE: tl.constexpr, HAS_MATCH: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    base = table_ptr + tl.load(rows_ptr + b) * W
    count = tl.load(lens_ptr + b)
    last = tl.minimum(tl.load(seq_lens_ptr + b), W - 1)
    if HAS_LIVE:
        # A padding request (at or past the live count) records nothing and scans nothing.
        live = b < tl.load(live_ptr)
        count = tl.where(live, count, 0)
        last = tl.where(live, last, 0)
    j = tl.arange(0, BLOCK_S)
    new = (j < count) & (j < stride)
    tl.store(base + last - count + 1 + j, tl.load(tokens_ptr + b * stride + j, mask=new), mask=new)
    # The scan reads what other threads of this program just wrote.
    tl.debug_barrier()
    best = tl.full((), -1, tl.int64)
    for start in range(0, last, BLOCK):
        p = start + tl.arange(0, BLOCK)
        run = p < last
        length = tl.zeros((BLOCK,), tl.int64)
        for k in tl.static_range(MAX_NGRAM):
            theirs = tl.load(base + last - k, mask=last >= k, other=-2)
            run = run & (p >= k) & (tl.load(base + p - k, mask=run & (p >= k), other=-1) == theirs)
            length += run.to(tl.int64)
        score = tl.where(length >= MIN_NGRAM, length * W + p, -1)
        best = tl.maximum(best, tl.max(score, axis=0))
    root = tl.load(base + last)
    end = best % W
    period = tl.maximum(last - end, 1)
    i = tl.arange(0, BLOCK_N)
    copy = (i >= 1) & (i < n) & (best + tl.zeros((BLOCK_N,), tl.int64) >= 0)
    src = tl.minimum(end + 1 + (i - 1) % period, W - 1)
    chain = tl.load(base + src, mask=copy, other=0)
    tl.store(out_ptr + b * n + i, tl.where(copy, chain, root), mask=i < n)
    if HAS_MATCH:
        tl.store(match_ptr + b, tl.where(best >= 0, best // W, 0))


def record_and_draft(table: torch.Tensor, rows: torch.Tensor, accept_tokens: torch.Tensor,
                     accept_lens: torch.Tensor, new_seq_lens: torch.Tensor, tree_size: int, max_ngram: int,
                     min_ngram: int, live: torch.Tensor | None = None, out: torch.Tensor | None = None,
                     match: torch.Tensor | None = None) -> torch.Tensor:
    """The Triton implementation of :func:`ngram_hal.speculative.lookup.record_and_draft` (same
    arguments, checks and result)."""
    B, W, stride, n = check_record_and_draft("lookup.record_and_draft", table, rows, accept_tokens, accept_lens,
                                             new_seq_lens, tree_size, live, out, match)
    if out is None:
        out = torch.empty(B * n, dtype=torch.int64, device=table.device)
    if B:
        lookup_kernel[(B,)](table, rows, accept_tokens, accept_lens, new_seq_lens, out if live is None else live,
                            out, out if match is None else match, W, stride, n, MAX_NGRAM=max_ngram,
                            MIN_NGRAM=min_ngram, BLOCK=SCAN_BLOCK, BLOCK_S=max(16, triton.next_power_of_2(stride)),
                            BLOCK_N=max(16, triton.next_power_of_2(n)), HAS_LIVE=live is not None,
                            HAS_MATCH=match is not None, num_warps=4)
    return out

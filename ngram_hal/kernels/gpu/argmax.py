"""The greedy token of each row of logits: the lowest index of its largest value, in two passes.

A decode step at batch 1 has one row of 49K-128K logits; torch's ``argmax`` of a float32 copy of
it took 27 us at a 128K vocabulary on an H200 (docs/h200.md). Here the first pass spreads each row
over programs of ``BLOCK`` logits that each keep their best (value and lowest index), the second
picks the best of a row's blocks. NaN counts as larger than any number,
as in ``torch.argmax`` (among NaN and +inf the lower index wins here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.pdl import await_previous, pdl_keywords

BLOCK = 4096
"""Logits one first-pass program reads."""


@triton.jit
def block_argmax_kernel(x_ptr, best_ptr, index_ptr, V, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * V + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
    x = tl.where(x != x, float("inf"), x)
    best = tl.max(x, 0)
    index = tl.min(tl.where(x == best, cols, V), 0)
    out = row * tl.num_programs(1) + block
    tl.store(best_ptr + out, best)
    tl.store(index_ptr + out, index)


@triton.jit
def row_argmax_kernel(best_ptr, index_ptr, out_ptr, blocks, V, BLOCK_B: tl.constexpr, PDL: tl.constexpr):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    b = tl.arange(0, BLOCK_B)
    ok = b < blocks
    best = tl.load(best_ptr + row * blocks + b, mask=ok, other=float("-inf"))
    index = tl.load(index_ptr + row * blocks + b, mask=ok, other=V)
    top = tl.max(best, 0)
    tl.store(out_ptr + row, tl.min(tl.where(ok & (best == top), index, V), 0).to(tl.int64))


def argmax(logits: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """The index of each row's largest logit (the lowest on a tie), as ``logits.argmax(-1)``.

    Args:
        logits: float[K, V] in any float dtype, contiguous; V below 2**31.
        pdl: launch with programmatic dependent launch (:mod:`ngram_hal.kernels.triton.pdl`).
    Returns:
        int64[K].
    """
    if logits.dim() != 2 or not logits.is_contiguous() or not logits.is_floating_point():
        raise ValueError(f"argmax: need contiguous float logits [K, V], got {tuple(logits.shape)} {logits.dtype}")
    K, V = logits.shape
    if V == 0 or V >= 2**31:
        raise ValueError(f"argmax: the vocabulary must hold 1 to 2**31 - 1 logits, got {V}")
    out = torch.empty(K, dtype=torch.int64, device=logits.device)
    if K:
        blocks = triton.cdiv(V, BLOCK)
        best = torch.empty((K, blocks), dtype=torch.float32, device=logits.device)
        index = torch.empty((K, blocks), dtype=torch.int32, device=logits.device)
        block_argmax_kernel[(K, blocks)](logits, best, index, V, BLOCK=BLOCK, num_warps=8, **pdl_keywords(pdl))
        row_argmax_kernel[(K,)](best, index, out, blocks, V, BLOCK_B=max(16, triton.next_power_of_2(blocks)),
                                num_warps=1, **pdl_keywords(pdl))
    return out

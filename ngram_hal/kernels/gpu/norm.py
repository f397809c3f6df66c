"""RMSNorm with the residual add fused in: one pass over each row."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.pdl import await_previous, pdl_keywords


@triton.jit
def rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, hidden, eps, ADD: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * hidden + cols, mask=ok, other=0.0)
    if ADD:
        delta = tl.load(delta_ptr + row * hidden + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + delta.to(tl.float32)).to(x.dtype)
        tl.store(x_ptr + row * hidden + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / hidden + eps)
    w = tl.load(weight_ptr + cols, mask=ok, other=0.0)
    normed = (xf * inv).to(x.dtype)
    tl.store(out_ptr + row * hidden + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(x.dtype), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, delta: torch.Tensor | None = None,
             pdl: bool = False) -> torch.Tensor:
    """``weight * rmsnorm(x)``; given ``delta``, first ``x += delta`` in place (the residual add).

    The norm is computed in float32, rounded to x's dtype, then scaled by ``weight`` (the order of
    :func:`ngram_hal.model_kernels.rms_norm`).

    Args:
        x: float[N, hidden], contiguous (updated in place when ``delta`` is given).
        weight: float[hidden] of x's dtype. delta: float[N, hidden] like x, or None.
        pdl: launch with programmatic dependent launch (:mod:`ngram_hal.kernels.triton.pdl`).
    Returns:
        float[N, hidden] in x's dtype.
    """
    N, hidden = x.shape
    if not x.is_contiguous() or weight.shape != (hidden,) or weight.dtype != x.dtype:
        raise ValueError(f"rms_norm: need contiguous x [N, {hidden}] and weight [{hidden}] of {x.dtype}")
    if delta is not None and (delta.shape != x.shape or delta.dtype != x.dtype or not delta.is_contiguous()):
        raise ValueError(f"rms_norm: delta must be contiguous {tuple(x.shape)} {x.dtype}")
    out = torch.empty_like(x)
    if N:
        rms_norm_kernel[(N,)](x, delta if delta is not None else x, weight, out, hidden, eps,
                               ADD=delta is not None, BLOCK=triton.next_power_of_2(hidden), num_warps=4,
                               **pdl_keywords(pdl))
    return out

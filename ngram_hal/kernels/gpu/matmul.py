"""The model's projections as one Triton product with the layer's neighbouring steps fused in.

``fused_linear`` computes ``x @ weight.T`` with float32 accumulation and can take, in the same
launch, the RMSNorm before the product (its weight folded into the product's, the row's scale
applied after the product), SwiGLU after a fused gate/up product, and the residual add, in place.
A decode step is made of launches, not of bytes (SmolLM2's projections read 0.3 to 3.5 MB each),
so folding the norms, the activation and the residual adds into the products removes three
launches a layer. Nothing runs between a tile's load and its matrix product, so the loads stay
pipelined.

Every row is computed by the same sequence of operations whatever the number of rows: the same
tile shape, the same walk over K, the same matrix instruction. With the fixed :data:`INVARIANT`
tiling a row's result therefore does not depend on its batch (cuBLAS picks its algorithm by shape,
so a 1-row decode and a 16-row verify can round the same row differently); that is
``invariant_linear``. (Under Triton's interpreter, whose half-precision products are wrong,
operands are widened to float32 first.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.launch import interpreting
from ..triton.pdl import await_previous, pdl_keywords
from ..triton.products import Tiling


# 32 output columns and 256 reduction steps a program: the fastest of the tilings that
# ``bench/bench_fused_linear.py --sweep`` times on an H200 for SmolLM2's layers at 1, 16 and 64 rows
# (fewer, longer reduction steps keep more of a weight in flight per program; a decode step's
# weights come from HBM, not L2).
SMALL_ROWS = Tiling(16, 32, 256)
INVARIANT = SMALL_ROWS


@triton.jit
def _dot(x, w, acc, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    """``acc + x @ w`` in float32: IEEE products for float32 operands; half-precision operands
    widened first under the interpreter."""
    if UPCAST:
        x = x.to(tl.float32)
        w = w.to(tl.float32)
    if IEEE:
        acc = tl.dot(x, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def linear_kernel(x_ptr, w_ptr, out_ptr, M, N, K, eps,
                   NORM: tl.constexpr, GLU: tl.constexpr, ADD: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_BLOCK: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr, PDL: tl.constexpr):
    await_previous(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        w_mask = col_ok[None, :] & (k < K)[:, None]
        w = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=w_mask, other=0.0)
        acc = _dot(x, w, acc, IEEE, UPCAST)
        if GLU:
            w_up = tl.load(w_ptr + (N + cols[None, :]) * K + k[:, None], mask=w_mask, other=0.0)
            acc_up = _dot(x, w_up, acc_up, IEEE, UPCAST)
    if NORM:
        # rmsnorm(x) @ (W * g).T = (x @ (W * g).T) / rms(x): the row's scale comes after the product.
        squares = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, NORM_BLOCK):
            k = k0 + tl.arange(0, NORM_BLOCK)
            xs = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                         other=0.0).to(tl.float32)
            squares += tl.sum(xs * xs, 1)
        inv = 1.0 / tl.sqrt(squares / K + eps)
        acc = acc * inv[:, None]
        acc_up = acc_up * inv[:, None]
    dtype = out_ptr.dtype.element_ty
    if GLU:
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
        y = (act.to(tl.float32) * acc_up.to(dtype).to(tl.float32)).to(dtype)
    else:
        y = acc.to(dtype)
    out_mask = row_ok[:, None] & col_ok[None, :]
    out_at = out_ptr + rows[:, None] * N + cols[None, :]
    if ADD:
        residual = tl.load(out_at, mask=out_mask, other=0.0)
        y = (residual.to(tl.float32) + y.to(tl.float32)).to(dtype)
    tl.store(out_at, y, mask=out_mask)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_eps: float | None = None, glu: bool = False,
                 residual: torch.Tensor | None = None, tiling: Tiling = INVARIANT, pdl: bool = False) -> torch.Tensor:
    """``y = f(x) @ weight.T`` with float32 accumulation, rounded to x's dtype; optionally
    ``residual += y`` in place.

    With ``norm_eps`` the rows of x are RMS-normalized first: ``y = rmsnorm(x) @ weight.T``, the
    norm's own weight already folded into ``weight`` (``W * g``, see :func:`fold_norm`); the product
    runs on x as it is and each row is scaled by ``1 / rms`` after it. With ``glu`` the weight
    holds gate and up rows ``[W_gate; W_up]`` and ``y = silu(x @ W_gate.T) * (x @ W_up.T)`` (the
    rounding of :func:`ngram_hal.kernels.gpu.swiglu.swiglu` applied to the two products).

    Args:
        x: float[M, K], contiguous.
        weight: float[N, K] of x's dtype, contiguous (float[2N, K] with ``glu``).
        norm_eps: the RMSNorm's epsilon, or None for no norm.
        residual: float[M, N] of x's dtype, contiguous, updated in place to ``residual + y``
            (rounded to its dtype after a float32 add) and returned.
        tiling: the program tile, warps and stages (:data:`SMALL_ROWS`, :data:`INVARIANT` or a
            :class:`~ngram_hal.kernels.triton.products.ProductTable`'s choice for the weight's
            shape); one tiling for every row count keeps rows batch-invariant.
        pdl: launch with programmatic dependent launch (:mod:`ngram_hal.kernels.triton.pdl`).
    Returns:
        float[M, N]: y, or the updated ``residual``.
    """
    M, K = x.shape
    rows_w, K_w = weight.shape
    N = rows_w // 2 if glu else rows_w
    if K_w != K or weight.dtype != x.dtype or not (x.is_contiguous() and weight.is_contiguous()) or (glu and rows_w % 2):
        raise ValueError(f"fused_linear: need contiguous x [M, K] and weight [{'2N' if glu else 'N'}, K] of one "
                         f"dtype, got x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    if residual is not None and (residual.shape != (M, N) or residual.dtype != x.dtype or not residual.is_contiguous()):
        raise ValueError(f"fused_linear: residual must be contiguous [{M}, {N}] of {x.dtype}, "
                         f"got {tuple(residual.shape)} {residual.dtype}")
    out = residual if residual is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(N, tiling.block_n), triton.cdiv(M, tiling.block_m))
        linear_kernel[grid](x, weight, out, M, N, K, 0.0 if norm_eps is None else norm_eps,
                             NORM=norm_eps is not None, GLU=glu, ADD=residual is not None, BLOCK_M=tiling.block_m,
                             BLOCK_N=tiling.block_n, BLOCK_K=tiling.block_k,
                             NORM_BLOCK=min(1024, triton.next_power_of_2(K)), IEEE=x.dtype == torch.float32,
                             UPCAST=x.dtype != torch.float32 and interpreting(), num_warps=tiling.num_warps,
                             num_stages=tiling.num_stages, **pdl_keywords(pdl))
    return out


def fold_norm(weight: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``weight * norm`` (float[N, K] times float[K], computed in float32, in weight's dtype): the
    weight that :func:`fused_linear` with ``norm_eps`` multiplies by."""
    return (weight.float() * norm.float()[None, :]).to(weight.dtype).contiguous()


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in the :data:`INVARIANT` tiling: float[M, K], float[N, K] -> float[M, N];
    rows batch-invariant."""
    return fused_linear(x, weight)

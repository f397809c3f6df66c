"""``x @ w.T`` with one fixed tiling whatever the number of rows: the batch-invariant product.

Each output row is computed by the same sequence of operations (the same tile shape, the same
walk over K, the same matrix instruction) whether the call has 1 row or 1,000, so a row's result
does not depend on the rest of its batch. cuBLAS picks its algorithm by shape, so a 1-row decode
and a 16-row verify can round the same row differently; this kernel cannot. (Under Triton's
interpreter, whose half-precision products are wrong, operands are widened to float32 first.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.launch import interpreting

BLOCK_M, BLOCK_N, BLOCK_K = 16, 32, 64


@triton.jit
def _matmul_kernel(x_ptr, w_ptr, out_ptr, M, N, K,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=(rows < M)[:, None] & (k < K)[None, :], other=0.0)
        w = tl.load(w_ptr + cols[None, :] * K + k[:, None], mask=(cols < N)[None, :] & (k < K)[:, None], other=0.0)
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=(rows < M)[:, None] & (cols < N)[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` with float32 accumulation, rounded to x's dtype; rows batch-invariant.

    Args:
        x: float[M, K], contiguous. weight: float[N, K] of x's dtype, contiguous.
    Returns:
        float[M, N].
    """
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape != (N, K) or weight.dtype != x.dtype or not (x.is_contiguous() and weight.is_contiguous()):
        raise ValueError(f"invariant_linear: need contiguous x [M, {K}] and weight [N, {K}] of {x.dtype}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(M, BLOCK_M))
        _matmul_kernel[grid](x, weight, out, M, N, K, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
                             IEEE=x.dtype == torch.float32, UPCAST=x.dtype != torch.float32 and interpreting(),
                             num_warps=4, num_stages=3)
    return out

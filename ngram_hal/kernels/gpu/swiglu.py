"""SwiGLU: ``silu(gate) * up`` from the fused gate/up projection, in one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.pdl import await_previous, pdl_keywords


@triton.jit
def swiglu_kernel(x_ptr, out_ptr, inter, BLOCK: tl.constexpr, PDL: tl.constexpr):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * 2 * inter + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * 2 * inter + inter + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * inter + cols, (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def swiglu(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * up``, the activation rounded to the input's dtype before the product (as
    ``F.silu(gate) * up`` does).

    Args:
        gate_up: float[N, 2 * I], gate columns first, contiguous.
        pdl: launch with programmatic dependent launch (:mod:`ngram_hal.kernels.triton.pdl`).
    Returns:
        float[N, I].
    """
    N, width = gate_up.shape
    if width % 2 or not gate_up.is_contiguous():
        raise ValueError(f"swiglu: need a contiguous [N, 2*I] input, got {tuple(gate_up.shape)}")
    inter = width // 2
    out = torch.empty((N, inter), dtype=gate_up.dtype, device=gate_up.device)
    if N:
        block = min(1024, triton.next_power_of_2(inter))
        swiglu_kernel[(N, triton.cdiv(inter, block))](gate_up, out, inter, BLOCK=block, num_warps=4, **pdl_keywords(pdl))
    return out

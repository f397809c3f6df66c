"""Rotary embedding of the new tokens' queries and keys, fused with the K/V store into the cache."""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..triton.pdl import await_previous, pdl_keywords


@triton.jit
def rotate_pair(x1, x2, cos, sin):
    """The "rotate half" rotation of float32 pairs ``(x1, x2)`` by ``cos``/``sin``: ``(x1 cos - x2 sin,
    x2 cos + x1 sin)``, its multiply-adds spelled out so that every kernel that rotates (this
    module's and the QKV product's epilogue) rounds alike whatever the compiler would fuse."""
    return tl.fma(x1, cos, -(x2 * sin)), tl.fma(x2, cos, x1 * sin)


@triton.jit
def rotary_store_kernel(qkv_ptr, pos_ptr, cos_sin_ptr, q_ptr, k_ptr, v_ptr, loc_ptr, max_pos, num_slots,
                         HQ: tl.constexpr, H: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_H: tl.constexpr, HALF: tl.constexpr, PDL: tl.constexpr):
    await_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    j = tl.arange(0, HALF)
    cos = tl.load(cos_sin_ptr + pos * HEAD_DIM + j)
    sin = tl.load(cos_sin_ptr + pos * HEAD_DIM + HALF + j)
    heads = tl.arange(0, BLOCK_H)
    width: tl.constexpr = (HQ + 2 * H) * HEAD_DIM
    base = qkv_ptr + row * width
    rotated = heads < HQ + H
    x1 = tl.load(base + heads[:, None] * HEAD_DIM + j[None, :], mask=rotated[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(base + heads[:, None] * HEAD_DIM + HALF + j[None, :], mask=rotated[:, None], other=0.0).to(tl.float32)
    y1, y2 = rotate_pair(x1, x2, cos[None, :], sin[None, :])
    y1 = y1.to(q_ptr.dtype.element_ty)
    y2 = y2.to(q_ptr.dtype.element_ty)
    is_q = heads < HQ
    q_out = q_ptr + row * HQ * HEAD_DIM + heads[:, None] * HEAD_DIM
    tl.store(q_out + j[None, :], y1, mask=is_q[:, None])
    tl.store(q_out + HALF + j[None, :], y2, mask=is_q[:, None])
    loc = tl.load(loc_ptr + row)
    if (loc >= 0) & (loc < num_slots):
        is_k = (heads >= HQ) & rotated
        kv_head = heads - HQ
        k_out = k_ptr + (loc * H + kv_head)[:, None] * HEAD_DIM
        tl.store(k_out + j[None, :], y1, mask=is_k[:, None])
        tl.store(k_out + HALF + j[None, :], y2, mask=is_k[:, None])
        d = tl.arange(0, 2 * HALF)
        vh = tl.arange(0, BLOCK_H)
        v_ok = vh < H
        v = tl.load(base + (HQ + H + vh)[:, None] * HEAD_DIM + d[None, :], mask=v_ok[:, None], other=0.0)
        tl.store(v_ptr + (loc * H + vh)[:, None] * HEAD_DIM + d[None, :], v, mask=v_ok[:, None])


def rope_table(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """float32[max_positions, head_dim]: ``cos(p * f)`` in the first half, ``sin(p * f)`` in the
    second, for the frequencies ``inv_freq`` (float32[head_dim / 2], on the device;
    :func:`ngram_hal.model_kernels.rope_frequencies`)."""
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device)
    freqs = positions.float().unsqueeze(1) * inv_freq
    return torch.cat([freqs.cos(), freqs.sin()], dim=1).contiguous()


class RopeStore(NamedTuple):
    """What the rotary embedding and the K/V store of one layer's new tokens take besides the QKV
    rows: positions int64[N], the cos/sin ``table`` float32[P, d] of :func:`rope_table`, the layer's
    caches float[S + 1, H, d] (contiguous), each row's slot ``out_cache_loc`` int64[N], and the
    query and KV head counts."""

    positions: torch.Tensor
    table: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    out_cache_loc: torch.Tensor
    num_heads: int
    num_kv_heads: int


def check_rope_store(op: str, rope: RopeStore, rows: int, width: int, dtype: torch.dtype) -> None:
    """A ValueError naming ``op`` unless ``rope`` fits ``rows`` QKV rows of ``width`` columns of
    ``dtype``."""
    Hq, H, d = rope.num_heads, rope.num_kv_heads, rope.table.shape[1]
    if width != (Hq + 2 * H) * d:
        raise ValueError(f"{op}: qkv must have {(Hq + 2 * H) * d} columns ({Hq} + 2 x {H} heads of {d}), got {width}")
    for name, t in (("positions", rope.positions), ("out_cache_loc", rope.out_cache_loc)):
        if t.shape != (rows,) or t.dtype != torch.int64:
            raise ValueError(f"{op}: {name} must be int64[{rows}], got {t.dtype}{list(t.shape)}")
    caches = (rope.k_cache, rope.v_cache)
    if any(c.shape[1:] != (H, d) or c.shape[0] < 1 or not c.is_contiguous() or c.dtype != dtype for c in caches):
        raise ValueError(f"{op}: caches must be contiguous [S+1, {H}, {d}] of {dtype}")
    if d & (d - 1) or d < 2:
        raise ValueError(f"{op}: head_dim {d} must be a power of two")


def rotary_store(qkv: torch.Tensor, positions: torch.Tensor, table: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, out_cache_loc: torch.Tensor, num_heads: int, num_kv_heads: int,
                 pdl: bool = False) -> torch.Tensor:
    """Rotate the queries and keys of N new tokens and write their K/V rows into one layer's cache.

    Rotation is "rotate half" (pairs ``i`` and ``i + d/2``) in float32, rounded once. Rows whose
    ``out_cache_loc`` is -1 (or outside the cache) are not stored; positions past the table are
    clamped to its last row.

    Args:
        qkv: float[N, (Hq + 2H) * d], the fused projection (queries, keys, values).
        positions: int64[N]. table: float32[P, d] from :func:`rope_table`.
        k_cache, v_cache: float[S + 1, H, d], one layer of the cache (contiguous).
        out_cache_loc: int64[N] slot of each token.
        pdl: launch with programmatic dependent launch (:mod:`ngram_hal.kernels.triton.pdl`).
    Returns:
        float[N, Hq, d] rotated queries in qkv's dtype.
    """
    N = qkv.shape[0]
    d = table.shape[1]
    Hq, H = num_heads, num_kv_heads
    if qkv.ndim != 2 or not qkv.is_contiguous():
        raise ValueError(f"rotary_store: qkv must be contiguous [N, {(Hq + 2 * H) * d}], got {tuple(qkv.shape)}")
    check_rope_store("rotary_store", RopeStore(positions, table, k_cache, v_cache, out_cache_loc, Hq, H), N,
                     qkv.shape[1], qkv.dtype)
    q = torch.empty((N, Hq, d), dtype=qkv.dtype, device=qkv.device)
    if N:
        rotary_store_kernel[(N,)](qkv, positions, table, q, k_cache, v_cache, out_cache_loc, table.shape[0],
                                   k_cache.shape[0] - 1, HQ=Hq, H=H, HEAD_DIM=d,
                                   BLOCK_H=triton.next_power_of_2(Hq + H), HALF=d // 2, num_warps=4,
                                   **pdl_keywords(pdl))
    return q

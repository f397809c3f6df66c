"""The model's projections as one Triton product with the layer's neighbouring steps fused in.

``fused_linear`` computes ``x @ weight.T`` with float32 accumulation and can take, in the same
launch, the RMSNorm before the product (its weight folded into the product's, the row's scale
applied after the product), SwiGLU after a fused gate/up product, and the residual add, in place.
A decode step is made of launches, not of bytes (SmolLM2's projections read 0.3 to 3.5 MB each),
so folding the norms, the activation and the residual adds into the products removes three
launches a layer. Nothing runs between a tile's load and its matrix product, so the loads stay
pipelined. The norm's sums of squares are the diagonal of ``x @ x.T``, taken on the matrix units
from the same tiles of x as the product, so the epilogue reads x no second time and holds no
``[rows, K]`` block of it in registers (a split product's last program, whose walk saw a run of K
only, reads x again).

Every row is computed by the same sequence of operations whatever the number of rows: the same
tile shape, the same walk over K, the same matrix instruction. With the fixed :data:`INVARIANT`
tiling a row's result therefore does not depend on its batch (cuBLAS picks its algorithm by shape,
so a 1-row decode and a 16-row verify can round the same row differently); that is
``invariant_linear``. (Under Triton's interpreter, whose half-precision products are wrong,
operands are widened to float32 first.)

The fused QKV product can also finish the rotary embedding and the K/V store (``rope``): a
program then takes pairs of columns, each query or key column ``i`` of a head with its rotation
partner ``i + d/2`` (values in two halves alike), as two accumulators (as a gate/up product
takes its gate and up columns), rounds each sum to the model's dtype as the product's output
would be rounded, rotates the pair in float32 by the cos/sin of the row's position and writes
the queries to their own tensor and the keys and values into the cache slots of the row. The
values are those of :func:`~ngram_hal.kernels.gpu.rotary.rotary_store` on the product's output;
one launch a layer and the QKV tensor's round trip fewer.

A product of a few rows over a weight with few output tiles (a 1B model's down projection at batch
1: 64 tiles of 32 columns, each a walk over 8,192 inputs, for an H200's 132 multiprocessors) leaves
the device's bandwidth idle; a tiling's ``split_k`` cuts its reduction into runs, one program each,
whose float32 partial sums the tile's last program adds in split order before the epilogue (one
launch, no atomics on the values, the same bits on every run). The product table takes it where the
sweep found it faster.

The row tiles of one run of output columns are neighbouring programs, so the programs resident at
once read the same columns of the weight and x (a few MB at most) stays in L2. On an H200 this made
SmolLM2's LM head (57 MB, larger than L2) in 16-row tiles at 272 and 1,088 rows 0.96x as long as
with the column tiles varying fastest; such tiles lose at many rows by their number of programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..triton.counters import tile_counters
from ..triton.launch import interpreting
from ..triton.pdl import await_previous, pdl_keywords
from ..triton.products import Tiling
from .rotary import RopeStore, check_rope_store, rotate_pair


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
def _epilogue(acc, acc_up, out_ptr, rows, cols, row_ok, col_ok, N, GLU: tl.constexpr, ADD: tl.constexpr):
    """The tile's finished float32 sums (the norm's row scale applied) to its output: SwiGLU, the
    residual add, the store."""
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


@triton.jit
def _row_squares(x_ptr, rows, row_ok, K, BLOCK_M: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """float32[BLOCK_M]: each row's sum of squares over all K of x, read again (a split product's
    last program, whose own walk saw a run of K only)."""
    squares = tl.zeros((BLOCK_M,), tl.float32)
    for k0 in range(0, K, NORM_BLOCK):
        k = k0 + tl.arange(0, NORM_BLOCK)
        xs = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :],
                     other=0.0).to(tl.float32)
        squares += tl.sum(xs * xs, 1)
    return squares


@triton.jit
def _rope_turns(pos_ptr, table_ptr, loc_ptr, max_pos, rows, pairs, row_ok, pair_ok, rotated,
                HEAD_DIM: tl.constexpr):
    """The rows' cos/sin for each column pair (1 and 0 where a pair is not rotated) and the rows'
    cache slots, float32[BLOCK_M, BLOCK_N] twice and int64[BLOCK_M]: loaded before the product's
    walk over K, so the epilogue waits on none of them."""
    HALF: tl.constexpr = HEAD_DIM // 2
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0)
    pos = tl.minimum(tl.maximum(pos, 0), max_pos - 1)
    j = tl.where(rotated, pairs % HALF, 0)
    angle = table_ptr + pos[:, None] * HEAD_DIM + j[None, :]
    turn = row_ok[:, None] & (pair_ok & rotated)[None, :]
    cos = tl.load(angle, mask=turn, other=1.0)
    sin = tl.load(angle + HALF, mask=turn, other=0.0)
    loc = tl.load(loc_ptr + rows, mask=row_ok, other=-1)
    return cos, sin, loc


@triton.jit
def _rope_epilogue(acc, acc_up, q_ptr, k_ptr, v_ptr, cos, sin, loc, num_slots, rows, pairs, col_a, col_b, row_ok,
                   pair_ok, rotated, HQ: tl.constexpr, H: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The QKV tile's finished sums (the norm's row scale applied; ``acc`` the columns ``col_a``,
    ``acc_up`` their partners ``col_b``) to rotated queries and the cache: each sum rounded to the
    output dtype, the pair rotated in float32 ("rotate half") by the rows' ``cos``/``sin``
    (:func:`_rope_turns`), rounded once; queries to ``q``, keys and values to the row's slot ``loc``
    (rows whose slot is -1 or outside the cache store none)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = q_ptr.dtype.element_ty
    x1 = acc.to(dtype).to(tl.float32)
    x2 = acc_up.to(dtype).to(tl.float32)
    r1, r2 = rotate_pair(x1, x2, cos, sin)
    y1 = tl.where(rotated[None, :], r1, x1).to(dtype)
    y2 = tl.where(rotated[None, :], r2, x2).to(dtype)
    is_q = pair_ok & (pairs < HQ * HALF)
    q_row = q_ptr + rows[:, None] * (HQ * HEAD_DIM)
    q_mask = row_ok[:, None] & is_q[None, :]
    tl.store(q_row + tl.where(is_q, col_a, 0)[None, :], y1, mask=q_mask)
    tl.store(q_row + tl.where(is_q, col_b, 0)[None, :], y2, mask=q_mask)
    stored = row_ok & (loc >= 0) & (loc < num_slots)
    slot = tl.where(stored, loc, 0) * (H * HEAD_DIM)
    is_k = pair_ok & rotated & ~is_q
    k_mask = stored[:, None] & is_k[None, :]
    tl.store(k_ptr + slot[:, None] + tl.where(is_k, col_a - HQ * HEAD_DIM, 0)[None, :], y1, mask=k_mask)
    tl.store(k_ptr + slot[:, None] + tl.where(is_k, col_b - HQ * HEAD_DIM, 0)[None, :], y2, mask=k_mask)
    is_v = pair_ok & ~rotated
    v_mask = stored[:, None] & is_v[None, :]
    tl.store(v_ptr + slot[:, None] + tl.where(is_v, col_a - (HQ + H) * HEAD_DIM, 0)[None, :], y1, mask=v_mask)
    tl.store(v_ptr + slot[:, None] + tl.where(is_v, col_b - (HQ + H) * HEAD_DIM, 0)[None, :], y2, mask=v_mask)


@triton.jit
def linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, K_SPLIT, eps,
                  q_ptr, k_ptr, v_ptr, pos_ptr, table_ptr, loc_ptr, max_pos, num_slots,
                  NORM: tl.constexpr, GLU: tl.constexpr, ADD: tl.constexpr, ROPE: tl.constexpr,
                  HQ: tl.constexpr, H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, NORM_BLOCK: tl.constexpr,
                  IEEE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr):
    await_previous(PDL)
    # Row tiles vary fastest (the module docstring).
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    if ROPE:
        # cols number column pairs: a query or key head's column i with its partner i + d/2, then
        # the values' columns in two halves. col_a and col_b are the pair's columns of the weight.
        HALF: tl.constexpr = HEAD_DIM // 2
        rotated = cols < (HQ + H) * HALF
        col_ok = cols < (HQ + 2 * H) * HALF
        col_a = tl.where(rotated, (cols // HALF) * HEAD_DIM + cols % HALF, (HQ + H) * HALF + cols)
        col_b = col_a + tl.where(rotated, HALF, H * HALF)
        cos, sin, loc = _rope_turns(pos_ptr, table_ptr, loc_ptr, max_pos, rows, cols, row_ok, col_ok, rotated,
                                    HEAD_DIM)
    else:
        col_ok = cols < N
        col_a = cols
        col_b = N + cols
    TWO: tl.constexpr = GLU or ROPE
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # The norm's sums of squares as the diagonal of x @ x.T, on the matrix units in the walk's own
    # order: the same bits whatever the tile, and no second read of x after the walk.
    GRAM: tl.constexpr = NORM and SPLIT == 1
    gram = tl.zeros((BLOCK_M, BLOCK_M), tl.float32)
    k_lo = 0
    k_hi = K
    if SPLIT > 1:
        k_lo = tl.program_id(2) * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * K + k[None, :], mask=row_ok[:, None] & (k < K)[None, :], other=0.0)
        if GRAM:
            gram = _dot(x, tl.trans(x), gram, IEEE, UPCAST)
        w_mask = col_ok[None, :] & (k < K)[:, None]
        w = tl.load(w_ptr + col_a[None, :] * K + k[:, None], mask=w_mask, other=0.0)
        acc = _dot(x, w, acc, IEEE, UPCAST)
        if TWO:
            w_up = tl.load(w_ptr + col_b[None, :] * K + k[:, None], mask=w_mask, other=0.0)
            acc_up = _dot(x, w_up, acc_up, IEEE, UPCAST)
    finish = SPLIT == 1
    if SPLIT > 1:
        # Each split stores its float32 sums; the tile's last split to count itself in adds them in
        # split order and finishes the tile (ngram_hal.kernels.triton.counters). The same bits
        # whichever split comes last.
        tile_mask = row_ok[:, None] & col_ok[None, :]
        split = tl.program_id(2)
        # Split s's sums of the tile, float32[(2 if TWO else 1) * SPLIT, M, N] (the second after the first).
        tl.store(part_ptr + ((split * M + rows[:, None]) * N + cols[None, :]), acc, mask=tile_mask)
        if TWO:
            tl.store(part_ptr + (((SPLIT + split) * M + rows[:, None]) * N + cols[None, :]), acc_up, mask=tile_mask)
        tile = pid_n * tl.num_programs(0) + pid_m
        tl.debug_barrier()
        finish = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLIT - 1
        if finish:
            tl.atomic_xchg(count_ptr + tile, 0)
            acc = tl.load(part_ptr + (rows[:, None] * N + cols[None, :]), mask=tile_mask, other=0.0,
                          cache_modifier=".cg")
            for s in tl.static_range(1, SPLIT):
                acc += tl.load(part_ptr + ((s * M + rows[:, None]) * N + cols[None, :]), mask=tile_mask, other=0.0,
                               cache_modifier=".cg")
            if TWO:
                acc_up = tl.load(part_ptr + ((SPLIT * M + rows[:, None]) * N + cols[None, :]), mask=tile_mask,
                                 other=0.0, cache_modifier=".cg")
                for s in tl.static_range(1, SPLIT):
                    acc_up += tl.load(part_ptr + (((SPLIT + s) * M + rows[:, None]) * N + cols[None, :]),
                                      mask=tile_mask, other=0.0, cache_modifier=".cg")
    if finish:
        if NORM:
            # rmsnorm(x) @ (W * g).T = (x @ (W * g).T) / rms(x): each row's scale after the product.
            if GRAM:
                own = tl.arange(0, BLOCK_M)
                squares = tl.sum(tl.where(own[:, None] == own[None, :], gram, 0.0), 1)
            else:
                squares = _row_squares(x_ptr, rows, row_ok, K, BLOCK_M, NORM_BLOCK)
            inv = 1.0 / tl.sqrt(squares / K + eps)
            acc = acc * inv[:, None]
            acc_up = acc_up * inv[:, None]
        if ROPE:
            _rope_epilogue(acc, acc_up, q_ptr, k_ptr, v_ptr, cos, sin, loc, num_slots, rows, cols, col_a, col_b, row_ok,
                           col_ok, rotated, HQ, H, HEAD_DIM)
        else:
            _epilogue(acc, acc_up, out_ptr, rows, cols, row_ok, col_ok, N, GLU, ADD)


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_eps: float | None = None, glu: bool = False,
                 residual: torch.Tensor | None = None, rope: RopeStore | None = None, tiling: Tiling = INVARIANT,
                 pdl: bool = False) -> torch.Tensor:
    """``y = f(x) @ weight.T`` with float32 accumulation, rounded to x's dtype; optionally
    ``residual += y`` in place, or the rotary embedding and K/V store of a QKV product.

    With ``norm_eps`` the rows of x are RMS-normalized first: ``y = rmsnorm(x) @ weight.T``, the
    norm's own weight already folded into ``weight`` (``W * g``, see :func:`fold_norm`); the product
    runs on x as it is and each row is scaled by ``1 / rms`` after it. With ``glu`` the weight
    holds gate and up rows ``[W_gate; W_up]`` and ``y = silu(x @ W_gate.T) * (x @ W_up.T)`` (the
    rounding of :func:`ngram_hal.kernels.gpu.swiglu.swiglu` applied to the two products). With
    ``rope`` the weight is the fused QKV projection's and y goes on as
    :func:`~ngram_hal.kernels.gpu.rotary.rotary_store` takes it: the rotated queries are returned,
    the keys and values written into the cache (a program takes ``max(16, block_n / 2)`` column
    pairs, the columns of ``block_n`` in two accumulators).

    Args:
        x: float[M, K], contiguous.
        weight: float[N, K] of x's dtype, contiguous (float[2N, K] with ``glu``; with ``rope``
            N = (Hq + 2H) * d of ``rope``'s heads).
        norm_eps: the RMSNorm's epsilon, or None for no norm.
        residual: float[M, N] of x's dtype, contiguous, updated in place to ``residual + y``
            (rounded to its dtype after a float32 add) and returned.
        rope: the positions, cos/sin table, one layer's caches and slots of the rows
            (:class:`~ngram_hal.kernels.gpu.rotary.RopeStore`); not with ``glu`` or ``residual``.
        tiling: the program tile, warps, stages and K splits (:data:`SMALL_ROWS`, :data:`INVARIANT` or a
            :class:`~ngram_hal.kernels.triton.products.ProductTable`'s choice for the weight's
            shape); one tiling for every row count keeps rows batch-invariant.
        pdl: launch with programmatic dependent launch (:mod:`ngram_hal.kernels.triton.pdl`).
    Returns:
        float[M, N]: y, or the updated ``residual``; with ``rope`` the queries float[M, Hq, d].
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
    block_n, columns = tiling.block_n, N
    rope_args: tuple = (x,) * 6 + (1, 1)
    heads = dict(HQ=1, H=1, HEAD_DIM=2)
    if rope is not None:
        if glu or residual is not None:
            raise ValueError("fused_linear: rope takes neither glu nor residual")
        check_rope_store("fused_linear", rope, M, N, x.dtype)
        d = rope.table.shape[1]
        out = torch.empty((M, rope.num_heads, d), dtype=x.dtype, device=x.device)
        block_n, columns = max(16, block_n // 2), N // 2
        rope_args = (out, rope.k_cache, rope.v_cache, rope.positions, rope.table, rope.out_cache_loc,
                     rope.table.shape[0], rope.k_cache.shape[0] - 1)
        heads = dict(HQ=rope.num_heads, H=rope.num_kv_heads, HEAD_DIM=d)
    else:
        out = residual if residual is not None else torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M:
        tiles = (triton.cdiv(M, tiling.block_m), triton.cdiv(columns, block_n))
        # K in runs of whole BLOCK_K steps, one per split (a short K may leave fewer splits).
        k_split = tiling.k_split(K)
        splits = triton.cdiv(K, k_split)
        partials = counters = x
        if splits > 1:
            two = glu or rope is not None
            partials = torch.empty(((2 if two else 1) * splits * M * N,), dtype=torch.float32, device=x.device)
            counters = tile_counters(x.device, tiles[0] * tiles[1], "fused_linear with a split K")
        linear_kernel[(*tiles, splits)](x, weight, out, partials, counters, M, N, K, k_split,
                                        0.0 if norm_eps is None else norm_eps, *rope_args,
                                        NORM=norm_eps is not None, GLU=glu, ADD=residual is not None,
                                        ROPE=rope is not None, **heads, BLOCK_M=tiling.block_m,
                                        BLOCK_N=block_n, BLOCK_K=tiling.block_k, SPLIT=splits,
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

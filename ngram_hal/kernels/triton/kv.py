"""KV-cache ops: store rows, move rows, and the moves that compact accepted tree nodes.

The cache's K and V are ``[L, S+1, H, d]``, contiguous; a row is ``H*d`` elements. Slot values
outside ``[0, S)`` (the -1 sentinel, and in default mode any out-of-range value) are skipped: no
kernel reads or writes a row for them, so nothing outside the cache is touched.

``move_kv`` parallelizes over the contents of the rows, not over the pairs: each program owns one
``(layer, K or V, block of columns)`` slice of every row and applies all N pairs to it. Programs
own disjoint slices, so there is no hazard between programs; inside a program every source read
is ordered before every destination write by a barrier (the threads that load an element are not
the threads that store to the same address, so without the barrier one could overwrite a source
another has not read yet). Up to ``move_pair_tile`` pairs the sources stay in registers; beyond
that each program copies its sources into its own region of a scratch buffer, then, after the
barrier, copies the scratch into the destinations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...kv_cache import KVCache
from .launch import LaunchConfig

I64 = torch.int64


def _check_cache(kv: KVCache) -> int:
    """The elements of one row, ``H*d``, once the kernels' assumption holds: contiguous K and V."""
    if not (kv.k.is_contiguous() and kv.v.is_contiguous()):
        raise ValueError("the Triton KV kernels need contiguous kv.k and kv.v of shape [L, S+1, H, d]")
    return kv.num_heads * kv.head_dim


def _warps(tile_bytes: int, cfg: LaunchConfig) -> int:
    return cfg.warps(max(1, tile_bytes // cfg.tile_bytes_per_thread))


# ---------------------------------------------------------------- store_kv


@triton.jit
def store_kv_kernel(k_cache, v_cache, locs_ptr, k_ptr, v_ptr, N, num_slots, row_len,
                     ROWS: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    in_rows = rows < N
    loc = tl.load(locs_ptr + rows, mask=in_rows, other=-1)
    ok = in_rows & (loc >= 0) & (loc < num_slots)
    m = ok[:, None] & (cols < row_len)[None, :]
    src = rows[:, None] * row_len + cols[None, :]
    dst = loc[:, None] * row_len + cols[None, :]
    tl.store(k_cache + dst, tl.load(k_ptr + src, mask=m), mask=m)
    tl.store(v_cache + dst, tl.load(v_ptr + src, mask=m), mask=m)


def store_kv(kv: KVCache, layer: int, locs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             cfg: LaunchConfig) -> None:
    """``kv.k[layer, locs[i]] = k[i]`` and the same for v, in one launch; locs of -1 are skipped.

    Args:
        kv: the cache (contiguous K/V, any of its dtypes). layer: host int in ``[0, L)``.
        locs: int64[N]. k, v: [N, H, d] of the cache's dtype, contiguous.
        cfg: the backend's launch configuration.
    """
    N = locs.shape[0]
    row_len = _check_cache(kv)
    if N == 0:
        return
    elt = kv.k.element_size()
    tile = max(1, cfg.kv_tile_bytes // elt)
    block_c = min(triton.next_power_of_2(row_len), tile)
    rows = min(max(1, tile // block_c), triton.next_power_of_2(N))
    grid = (triton.cdiv(N, rows), triton.cdiv(row_len, block_c))
    store_kv_kernel[grid](kv.k[layer], kv.v[layer], locs, k, v, N, kv.num_slots, row_len,
                           ROWS=rows, BLOCK_C=block_c, num_warps=_warps(rows * block_c * elt, cfg), **cfg.options())


# ---------------------------------------------------------------- move_kv


@triton.jit
def _move_pairs(src_ptr, dst_ptr, i, N, num_slots):
    """Source and destination rows of pairs ``i`` and which of them move (both in range, distinct)."""
    pm = i < N
    s = tl.load(src_ptr + i, mask=pm, other=-1)
    d = tl.load(dst_ptr + i, mask=pm, other=-1)
    live = pm & (s >= 0) & (s < num_slots) & (d >= 0) & (d < num_slots) & (s != d)
    return s, d, live


@triton.jit
def move_kv_kernel(k_cache, v_cache, src_ptr, dst_ptr, scratch_ptr, N, num_slots, row_len, layer_stride,
                    num_col_blocks, BLOCK_C: tl.constexpr, PAIR_TILE: tl.constexpr, USE_SCRATCH: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    part = pid // num_col_blocks
    base = tl.where(part % 2 == 1, v_cache, k_cache) + (part // 2) * layer_stride
    c = tl.arange(0, BLOCK_C)
    cols = (pid % num_col_blocks) * BLOCK_C + c
    in_cols = (cols < row_len)[None, :]
    pairs = tl.arange(0, PAIR_TILE)
    if USE_SCRATCH:
        region = scratch_ptr + pid * N * BLOCK_C
        for p0 in range(0, N, PAIR_TILE):
            i = p0 + pairs
            s, d, live = _move_pairs(src_ptr, dst_ptr, i, N, num_slots)
            m = live[:, None] & in_cols
            rows = tl.load(base + s[:, None] * row_len + cols[None, :], mask=m)
            tl.store(region + i[:, None] * BLOCK_C + c[None, :], rows, mask=m)
        tl.debug_barrier()
        for p0 in range(0, N, PAIR_TILE):
            i = p0 + pairs
            s, d, live = _move_pairs(src_ptr, dst_ptr, i, N, num_slots)
            m = live[:, None] & in_cols
            rows = tl.load(region + i[:, None] * BLOCK_C + c[None, :], mask=m)
            tl.store(base + d[:, None] * row_len + cols[None, :], rows, mask=m)
    else:
        s, d, live = _move_pairs(src_ptr, dst_ptr, pairs, N, num_slots)
        m = live[:, None] & in_cols
        rows = tl.load(base + s[:, None] * row_len + cols[None, :], mask=m)
        tl.debug_barrier()
        tl.store(base + d[:, None] * row_len + cols[None, :], rows, mask=m)


def move_kv(kv: KVCache, src: torch.Tensor, dst: torch.Tensor, cfg: LaunchConfig) -> None:
    """In every layer, K and V: ``row[dst[i]] = row[src[i]]``, every source read before any write.

    One launch for all layers and both K and V, whatever N: sources may overlap destinations
    (chains, cycles, fan-out); pairs with a side outside ``[0, S)`` (such as -1) or with
    ``src == dst`` do nothing.

    Args:
        kv: the cache (contiguous K/V). src, dst: int64[N], contiguous.
        cfg: the backend's launch configuration (``kv_segment_bytes``, ``move_pair_tile``).
    """
    N = src.shape[0]
    row_len = _check_cache(kv)
    if N == 0:
        return
    elt = kv.k.element_size()
    block_c = min(triton.next_power_of_2(row_len), max(1, cfg.kv_segment_bytes // elt))
    num_col_blocks = triton.cdiv(row_len, block_c)
    programs = 2 * kv.num_layers * num_col_blocks
    use_scratch = N > cfg.move_pair_tile
    if use_scratch:
        pair_tile = cfg.move_pair_tile
        scratch = torch.empty((programs, N, block_c), dtype=kv.dtype, device=kv.k.device)
    else:
        pair_tile = max(triton.next_power_of_2(N), min(16, cfg.move_pair_tile))
        scratch = kv.k  # not read: stands in for the scratch pointer the register path never uses
    move_kv_kernel[(programs,)](kv.k, kv.v, src, dst, scratch, N, kv.num_slots, row_len,
                                 (kv.num_slots + 1) * row_len, num_col_blocks, BLOCK_C=block_c,
                                 PAIR_TILE=pair_tile, USE_SCRATCH=use_scratch,
                                 num_warps=_warps(pair_tile * block_c * elt, cfg), **cfg.options())


# ---------------------------------------------------------------- accepted_kv_moves


@triton.jit
def accepted_kv_moves_kernel(out_cache_loc, accept_ptr, table_ptr, rows_ptr, seq_ptr, src_ptr, dst_ptr,
                              B, D, num_rows, row_len, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.arange(0, BLOCK_D)
    in_b = b < B
    m = in_b[:, None] & (j < D)[None, :]
    flat = b[:, None] * D + j[None, :]
    node = tl.load(accept_ptr + flat, mask=m, other=-1)
    # A request's accepted nodes are the entries before its first -1 (or out-of-range node id).
    good = (node >= 0) & (node < B * D)
    first_bad = tl.min(tl.where(good, BLOCK_D, j[None, :]), axis=1)
    accepted = m & (j[None, :] < first_bad[:, None])
    src = tl.load(out_cache_loc + node, mask=accepted, other=-1)
    r = tl.load(rows_ptr + b, mask=in_b, other=-1)
    col = tl.load(seq_ptr + b, mask=in_b, other=0)[:, None] + j[None, :]
    cell_ok = accepted & ((r >= 0) & (r < num_rows))[:, None] & (col >= 0) & (col < row_len)
    dst = tl.load(table_ptr + r[:, None] * row_len + col, mask=cell_ok, other=-1)
    tl.store(src_ptr + flat, src, mask=m)
    tl.store(dst_ptr + flat, tl.where(accepted, dst, -1), mask=m)


def accepted_kv_moves(out_cache_loc: torch.Tensor, accept_index: torch.Tensor, req_to_token: torch.Tensor,
                      req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                      cfg: LaunchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The moves that compact accepted tree nodes, in one launch.

    Args:
        out_cache_loc: int64[B*D]. accept_index: int64[B, D]. req_to_token: int64[R, M].
        req_pool_indices, seq_lens: int64[B]. All contiguous. cfg: the launch configuration.
    Returns:
        ``(src, dst)``, each int64[B*D] on the inputs' device: entry ``b*D + j`` for the j-th
        accepted node of request b (the entries of ``accept_index[b]`` before its first -1) is
        ``out_cache_loc[accept_index[b, j]]`` and ``req_to_token[r_b, seq_lens[b] + j]``; -1 elsewhere.
    """
    B, D = accept_index.shape
    dev = accept_index.device
    src = torch.empty(B * D, dtype=I64, device=dev)
    dst = torch.empty(B * D, dtype=I64, device=dev)
    if B * D == 0:
        return src, dst
    R, M = req_to_token.shape
    block_d = triton.next_power_of_2(D)
    rows = min(max(1, cfg.index_block // block_d), triton.next_power_of_2(B))
    accepted_kv_moves_kernel[(triton.cdiv(B, rows),)](out_cache_loc, accept_index, req_to_token, req_pool_indices,
                                                       seq_lens, src, dst, B, D, R, M, ROWS=rows, BLOCK_D=block_d,
                                                       num_warps=cfg.num_warps, **cfg.options())
    return src, dst


class TritonKvOps:
    """Mixin: the KV-cache kernels as the ``_<op>`` of :class:`~ngram_hal.backend.Backend` (which
    has validated the arguments), launched with the backend's ``launch``."""

    def _store_kv(self, *args):
        return store_kv(*args, self.launch)

    def _move_kv(self, *args):
        return move_kv(*args, self.launch)

    def _accepted_kv_moves(self, *args):
        return accepted_kv_moves(*args, self.launch)

"""Paged attention over the KV cache: prefill, decode, mixed extends and tree verify, grouped-query.

Work split. The queries of a batch are cut into *tiles* of up to ``BLOCK_Q`` consecutive queries of
one request. A program takes one tile, one KV head and one range of key positions: its rows are
the tile's queries times the ``G = Hq / H`` query heads that share the KV head (``BLOCK_M >=
BLOCK_Q * G`` rows, so a decode step still feeds the matrix units), and it walks its keys in
blocks of ``BLOCK_N``, reading each key's slot from ``req_to_token`` and the K/V rows from the
cache (any page size: the table maps positions to slots one by one), with an online softmax.
When tiles times heads are too few to fill the device, the key range is split (flash-decoding) and
a second kernel folds the splits' unnormalised softmax states in split order
(:func:`fold_split`). The number of splits follows the
host's bound on the keys; each request's own keys are then shared evenly by the splits (whole key
blocks), so a short context in a step captured for long ones still spreads over every split.

The tile table depends only on the batch's metadata, so :func:`attention_layout` builds it once per
forward (a few torch ops on the device, no host sync) and every layer reuses it. Its size is a host
bound: ``sum_b ceil(q_b / BLOCK_Q) <= min(N, (N + B * (BLOCK_Q - 1)) // BLOCK_Q)``.

Batch-invariant mode: every query walks its keys in chunks and blocks at fixed positions, with the
same tile shape whatever the batch. Their number follows the host's bound on the keys (a captured
step's: the request table's width), most of them past a short context, so a program takes every
so-many-th chunk of its tile, as many programs as fill the device a few times over
(``LaunchConfig.attn_invariant_fill``, chosen by ``bench/bench_attention_verify.py``); where a
call's tiles fill the device ``attn_invariant_fold`` times over, one program per tile and head
walks them all and folds their results as the merge would, with no merge launch (the same bits).
A tree node there reads its ancestors (root first, then itself) at the positions after the prefix
that plain decoding gives them once accepted, instead of the tree's slots under its mask: its
result is bit for bit the one a decode step of the same token computes, which is what keeps greedy
speculation with branching trees identical to greedy decoding (chains sit at those positions
already). The key splits wholly before the tree are the same for every node, so one tile of a
request's nodes reads them once; each node takes a tile of its own for the split the tree starts
in and those after it.

Triton's interpreter computes a bfloat16 ``tl.dot`` wrongly, so there (and only there) bfloat16
operands are widened to float32 before each product.

A layout's ``q_active`` leaves a request's queries from that count on out: their rows see no key
(zero output), and a tile of them walks none, so a verify step's nodes past a short draft cost
little more than the launch.

Robustness: keys whose slot lies outside the cache, positions past a request's ``kv_lens`` or the
table's width, and requests whose pool row is out of range are masked, never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...layout import AttentionLayout
from ...kv_cache import KVCache
from .launch import LaunchConfig, interpreting, num_programs_to_fill, pow2_floor
from .pdl import await_previous, pdl_keywords

_LOG2E = 1.4426950408889634


@triton.jit
def fold_split(run_m, run_w, run_o, m, w, o):
    """Fold one key split's softmax state into the running state of the splits before it, in split order.

    A state is unnormalised: m: float32[R], the log2 of the scale its weights are taken against
    (-inf where it saw no key), w: float32[R], the softmax mass at that scale, o: float32[R, D], the
    values weighted at that scale; its output is ``o / w``. A split that saw no key (``w == 0``) leaves
    the rows as they were, whatever its o holds. Returns the new (run_m, run_w, run_o); the first
    split folds into (-inf, 0, 0). Elementwise, with fused multiply-adds spelled out, so a program
    that walks its splits and folds them as it goes and the merge of splits computed apart give the
    same bits."""
    top = tl.maximum(run_m, m)
    top_safe = tl.where(top == float("-inf"), 0.0, top)
    keep = tl.exp2(run_m - top_safe)
    add = tl.exp2(m - top_safe)
    empty = w == 0.0
    o = tl.where(empty[:, None], 0.0, o)
    return (tl.where(empty, run_m, top), tl.where(empty, run_w, tl.fma(run_w, keep, w * add)),
            tl.where(empty[:, None], run_o, tl.fma(run_o, keep[:, None], o * add[:, None])))


@triton.jit(do_not_specialize=["B", "R", "M", "S", "N", "chunk", "SPLITS"])
def attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, mid_o_ptr, mid_m_ptr, mid_w_ptr, fold_m_ptr, fold_w_ptr, fold_o_ptr,
    req_to_token_ptr, req_pool_ptr, kv_lens_ptr, q_lens_ptr, q_start_ptr, active_ptr,
    tile_req_ptr, tile_q0_ptr, tree_mask_ptr, path_ptr,
    B, R, M, S, N, stride_slot, sm_scale_log2, chunk, SPLITS,
    Hq: tl.constexpr, H: tl.constexpr, HEAD_DIM: tl.constexpr, TREE_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT: tl.constexpr, EVEN: tl.constexpr, PATH: tl.constexpr, PART: tl.constexpr, FOLD: tl.constexpr,
    ACTIVE: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr, PDL: tl.constexpr,
):
    await_previous(PDL)
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_req_ptr + tile)
    if b < B:
        G: tl.constexpr = Hq // H
        q0 = tl.load(tile_q0_ptr + tile)
        r = tl.load(req_pool_ptr + b)
        kv_len = tl.load(kv_lens_ptr + b)
        q_len = tl.load(q_lens_ptr + b)
        row0 = tl.load(q_start_ptr + b)
        valid_req = (r >= 0) & (r < R)
        kv_len = tl.where(valid_req, tl.minimum(tl.maximum(kv_len, 0), M), 0)
        prefix = kv_len - q_len

        rows = tl.arange(0, BLOCK_M)
        qi = q0 + rows // G
        head = h * G + rows % G
        row_ok = (rows < BLOCK_Q * G) & (qi < q_len) & (row0 + qi < N) & (row0 + qi >= 0)
        n_row = (row0 + qi).to(tl.int64)
        cols = tl.arange(0, BLOCK_D)
        col_ok = cols < HEAD_DIM
        q = tl.load(q_ptr + (n_row * Hq + head)[:, None] * HEAD_DIM + cols[None, :],
                    mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        # The keys this tile can see: causal queries end at their own position, tree nodes at kv_len,
        # or, reading their path (one tree node per tile), after their own depth.
        path_row = path_ptr + (b * TREE_D + q0) * (TREE_D + 1)
        if PATH:
            kv_end = prefix + tl.load(path_row + TREE_D)
        elif TREE_D > 0:
            kv_end = kv_len
        else:
            kv_end = tl.minimum(kv_len, prefix + q0 + BLOCK_Q)
        # ACTIVE: the request's queries from active_ptr[b] on see no key (zero rows); a tile of
        # them walks no key at all.
        row_sees = row_ok
        if ACTIVE:
            active = tl.load(active_ptr + b)
            row_sees = row_ok & (qi < active)
            kv_end = tl.where(q0 < active, kv_end, 0)
        span = chunk.to(tl.int64)
        if EVEN:
            # The request's own keys shared evenly by the splits (whole key blocks, at least
            # ``chunk`` keys each), not the host's bound on every request's keys.
            span = tl.maximum(span, tl.cdiv(tl.cdiv(kv_len, SPLITS), BLOCK_N) * BLOCK_N)
        # PART 1 takes only the splits wholly before the tree (keys every node of a tile sees), PART 2
        # only the others: a verify step's nodes share the reads of the prefix's splits.
        first = 0
        last = SPLITS
        if PART == 1:
            last = tl.minimum(SPLITS, tl.maximum(prefix, 0) // span)
        if PART == 2:
            first = tl.maximum(prefix, 0) // span
        # FOLD: this program walks every split in order and folds each one's result into a running
        # one (fold_split), instead of storing it for the merge; PART 2 continues the fold PART 1
        # left for its rows, PART 1 leaves it.
        run_m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        run_w = tl.zeros((BLOCK_M,), tl.float32)
        run_o = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        fold_row = n_row * Hq + head
        if FOLD and PART == 2:
            run_m = tl.load(fold_m_ptr + fold_row, mask=row_ok, other=float("-inf"))
            run_w = tl.load(fold_w_ptr + fold_row, mask=row_ok, other=0.0)
            run_o = tl.load(fold_o_ptr + fold_row[:, None] * HEAD_DIM + cols[None, :],
                            mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        # This program's splits: every ``num_programs(2)``-th from ``first`` (one each outside the
        # batch-invariant mode). A split past the keys only marks itself empty for the merge.
        for split in range(first + tl.program_id(2), last, tl.num_programs(2)):
            start = split * span
            end = tl.minimum(start + span, kv_end)
            part = (split * N + n_row) * Hq + head
            if start < end:
                m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
                l_i = tl.zeros((BLOCK_M,), tl.float32)
                acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
                table_row = req_to_token_ptr + r.to(tl.int64) * M
                kv_base = h * HEAD_DIM
                for n0 in range(start, end, BLOCK_N):
                    pos = n0 + tl.arange(0, BLOCK_N)
                    in_range = pos < end
                    rel = pos - prefix
                    if PATH:
                        node = tl.load(path_row + rel, mask=in_range & (rel >= 0) & (rel < TREE_D), other=0)
                        slot = tl.load(table_row + tl.where(rel >= 0, prefix + node, pos), mask=in_range, other=-1)
                    else:
                        slot = tl.load(table_row + pos, mask=in_range, other=-1)
                    key_ok = in_range & (slot >= 0) & (slot < S)
                    offs = kv_base + slot * stride_slot
                    k = tl.load(k_ptr + offs[:, None] + cols[None, :], mask=key_ok[:, None] & col_ok[None, :],
                                other=0.0)
                    if UPCAST:
                        k = k.to(tl.float32)
                    if IEEE:
                        qk = tl.dot(q, tl.trans(k), input_precision="ieee")
                    else:
                        qk = tl.dot(q, tl.trans(k))
                    rel = rel[None, :]
                    if PATH:
                        visible = in_range[None, :]
                    elif TREE_D > 0:
                        in_tree = (rel >= 0) & (rel < TREE_D)
                        seen = tl.zeros((BLOCK_M, BLOCK_N), tl.uint8)
                        if n0 + BLOCK_N > prefix:
                            # Only the blocks that reach the tree read its mask (before it, every
                            # key is visible).
                            seen = tl.load(tree_mask_ptr + (b * TREE_D + qi[:, None]) * TREE_D + rel,
                                           mask=(row_ok & (qi < TREE_D))[:, None] & in_tree & key_ok[None, :],
                                           other=0)
                        visible = (rel < 0) | (in_tree & (seen != 0))
                    else:
                        visible = rel <= qi[:, None]
                    visible = visible & key_ok[None, :] & row_sees[:, None]
                    qk = tl.where(visible, qk * sm_scale_log2, float("-inf"))
                    m_new = tl.maximum(m_i, tl.max(qk, 1))
                    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                    p = tl.exp2(qk - m_safe[:, None])
                    alpha = tl.exp2(m_i - m_safe)
                    l_i = l_i * alpha + tl.sum(p, 1)
                    v = tl.load(v_ptr + offs[:, None] + cols[None, :], mask=key_ok[:, None] & col_ok[None, :],
                                other=0.0)
                    if UPCAST:
                        v = v.to(tl.float32)
                    if IEEE:
                        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
                    else:
                        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
                    m_i = m_new

                # The split's state stays unnormalised (fold_split): the fold and the merge take it
                # as it is, and only the output divides.
                if FOLD:
                    run_m, run_w, run_o = fold_split(run_m, run_w, run_o, m_i, l_i, acc)
                elif SPLIT:
                    tl.store(mid_m_ptr + part, m_i, mask=row_ok)
                    tl.store(mid_w_ptr + part, l_i, mask=row_ok)
                    tl.store(mid_o_ptr + part[:, None] * HEAD_DIM + cols[None, :], acc,
                             mask=row_ok[:, None] & col_ok[None, :])
                else:
                    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
                    tl.store(out_ptr + fold_row[:, None] * HEAD_DIM + cols[None, :],
                             o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            elif not FOLD:
                if SPLIT:
                    tl.store(mid_m_ptr + part, tl.full((BLOCK_M,), float("-inf"), tl.float32), mask=row_ok)
                    tl.store(mid_w_ptr + part, tl.zeros((BLOCK_M,), tl.float32), mask=row_ok)
                else:
                    tl.store(out_ptr + fold_row[:, None] * HEAD_DIM + cols[None, :],
                             tl.zeros((BLOCK_M, BLOCK_D), tl.float32).to(out_ptr.dtype.element_ty),
                             mask=row_ok[:, None] & col_ok[None, :])
        if FOLD and PART == 1:
            tl.store(fold_m_ptr + fold_row, run_m, mask=row_ok)
            tl.store(fold_w_ptr + fold_row, run_w, mask=row_ok)
            tl.store(fold_o_ptr + fold_row[:, None] * HEAD_DIM + cols[None, :], run_o,
                     mask=row_ok[:, None] & col_ok[None, :])
        elif FOLD:
            o = run_o / tl.where(run_w > 0, run_w, 1.0)[:, None]
            tl.store(out_ptr + fold_row[:, None] * HEAD_DIM + cols[None, :], o.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def merge_kernel(mid_o_ptr, mid_m_ptr, mid_w_ptr, out_ptr, ROWS, SPLITS, HEAD_DIM: tl.constexpr,
                 BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, SKIP_EMPTY: tl.constexpr,
                 PDL: tl.constexpr):
    """out[r] for ``BLOCK_R`` rows r (query x query head) of ``ROWS``: the splits' states
    (``mid_*[split, r]``, unnormalised: :func:`fold_split`) folded in split order, ``BLOCK_S`` splits'
    loads issued together (none waits for another split's value). ``SKIP_EMPTY``: a split's values are
    read only where its mass says it saw keys, so the splits past a context (most of the
    batch-invariant mode's, whose splits follow the host's bound) cost little traffic, for one more
    wait (that load follows the mass's). Elementwise per row, so neither that nor the rows a program
    takes changes a row's bits."""
    await_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < ROWS
    cols = tl.arange(0, BLOCK_D)
    col_ok = cols < HEAD_DIM
    run_m = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    run_w = tl.zeros((BLOCK_R,), tl.float32)
    run_o = tl.zeros((BLOCK_R, BLOCK_D), tl.float32)
    for s0 in range(0, SPLITS, BLOCK_S):
        for i in tl.static_range(BLOCK_S):
            split = tl.zeros((BLOCK_R,), tl.int64) + s0 + i
            part = split * ROWS + rows
            ok = row_ok & (split < SPLITS)
            m = tl.load(mid_m_ptr + part, mask=ok, other=float("-inf"))
            w = tl.load(mid_w_ptr + part, mask=ok, other=0.0)
            # An empty split stored its scale and mass only (-inf, 0): its values are not read, and
            # fold_split leaves its rows as they were.
            seen = ok & (w != 0.0) if SKIP_EMPTY else ok
            o = tl.load(mid_o_ptr + part[:, None] * HEAD_DIM + cols[None, :], mask=seen[:, None] & col_ok[None, :],
                        other=0.0)
            run_m, run_w, run_o = fold_split(run_m, run_w, run_o, m, w, o)
    merged = run_o / tl.where(run_w > 0, run_w, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * HEAD_DIM + cols[None, :], merged.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["B", "count"])
def plan_kernel(q_lens_ptr, q_lens_out, q_start_out, tile_req_out, tile_q0_out, B, count,
                BLOCK_Q: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """One program: the batch's query lengths (negatives as 0) and offsets, and its tile table for
    tiles of ``BLOCK_Q`` queries: tile t belongs to the request whose tiles' running count first
    passes t (B past the last), and starts at query ``q0`` of it."""
    b = tl.arange(0, BLOCK_B)
    in_batch = b < B
    q_lens = tl.maximum(tl.load(q_lens_ptr + b, mask=in_batch, other=0), 0)
    tl.store(q_lens_out + b, q_lens, mask=in_batch)
    tl.store(q_start_out + b, tl.cumsum(q_lens, 0) - q_lens, mask=in_batch)
    per_req = (q_lens + BLOCK_Q - 1) // BLOCK_Q
    ends = tl.cumsum(per_req, 0)
    first = ends - per_req
    for t0 in range(0, count, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        req = tl.sum(((ends[None, :] <= t[:, None]) & in_batch[None, :]).to(tl.int64), 1)
        owner = tl.minimum(req, B - 1)
        start = tl.sum(tl.where(b[None, :] == owner[:, None], first[None, :], 0), 1)
        tl.store(tile_req_out + t, req, mask=t < count)
        tl.store(tile_q0_out + t, (t - start) * BLOCK_Q, mask=t < count)


@dataclass
class _Tiles:
    """The tile table for one tile height: ``req[t]`` (B for an unused tile) and ``q0[t]``."""

    block_q: int
    req: torch.Tensor
    q0: torch.Tensor


class Plan:
    """The per-forward metadata of :func:`attention`: query lengths and offsets and, per tile
    height, the tile table, made by :func:`plan_kernel` on first use (every layer of a forward
    uses the same height; the lengths and offsets are valid once a table is made)."""

    def __init__(self, layout: AttentionLayout, cfg: LaunchConfig):
        self._raw_q_lens = layout.q_lens
        self.q_lens = torch.empty_like(layout.q_lens)
        self.q_start = torch.empty_like(layout.q_lens)
        self._tiles: dict[int, _Tiles] = {}
        self._path: torch.Tensor | None = None
        self._cfg = cfg
        self.batch_size = layout.batch_size
        self.num_queries = layout.num_queries

    def path(self, tree_mask: torch.Tensor) -> torch.Tensor:
        """int64[B, D, D + 1]: for tree node i of request b, ``path[b, i, t]`` is its ancestor at depth
        t (t = 0 the root, up to its own depth: itself) and ``path[b, i, D]`` the nodes on that
        path. Built on first use."""
        if self._path is None:
            B, D, _ = tree_mask.shape
            count = tree_mask.sum(-1)
            depth_of = torch.where(tree_mask, (count - 1)[:, None, :], D)
            nodes = torch.arange(D, dtype=torch.int64, device=tree_mask.device).expand(B, D, D)
            path = torch.zeros((B, D, D + 1), dtype=torch.int64, device=tree_mask.device)
            path.scatter_(2, depth_of, nodes)
            path[:, :, D] = count
            self._path = path
        return self._path

    def tiles(self, block_q: int) -> _Tiles:
        """The tile table for tiles of ``block_q`` queries (``block_q`` int64 tables of a host
        bound on the tiles: ``min(N, (N + B * (block_q - 1)) // block_q)``)."""
        found = self._tiles.get(block_q)
        if found is None:
            B, N = self.batch_size, self.num_queries
            count = min(N, (N + B * (block_q - 1)) // block_q)
            device = self._raw_q_lens.device
            found = _Tiles(block_q, torch.empty(count, dtype=torch.int64, device=device),
                           torch.empty(count, dtype=torch.int64, device=device))
            plan_kernel[(1,)](self._raw_q_lens, self.q_lens, self.q_start, found.req, found.q0, B, count,
                              BLOCK_Q=block_q, BLOCK_B=max(16, triton.next_power_of_2(B)), BLOCK_T=32,
                              num_warps=self._cfg.num_warps, **self._cfg.options())
            self._tiles[block_q] = found
        return found


def attention_layout(layout: AttentionLayout, cfg: LaunchConfig) -> Plan:
    """The plan of one batch: built once, used by every layer's :func:`attention`."""
    return Plan(layout, cfg)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def attention(q: torch.Tensor, kv: KVCache, layer: int, layout: AttentionLayout, sm_scale: float,
              cfg: LaunchConfig) -> torch.Tensor:
    """Paged attention of one layer (see :meth:`ngram_hal.Backend.attention`).

    Args:
        q: float[N, Hq, d] of the cache's dtype. layout: from :meth:`ngram_hal.Backend.attention_layout`.
    Returns:
        float[N, Hq, d] in q's dtype; float32 accumulation.
    """
    N, Hq, d = q.shape
    H = kv.num_heads
    G = Hq // H
    B = layout.batch_size
    out = torch.empty_like(q)
    if N == 0 or B == 0:
        return out
    plan: Plan = layout.plan
    tree = layout.tree_mask
    tree_d = tree.shape[1] if tree is not None else 0
    per_req = tree_d if tree is not None else -(-N // B)
    # Tree verify takes shorter tiles than prefill (attn_tree_block_m): more programs over a request's nodes.
    max_m = max(16, _pow2(G), cfg.attn_tree_block_m if tree is not None else cfg.attn_block_m)
    # The batch-invariant mode runs one tile height for every step (a row's bits depend on it):
    # attn_invariant_block_m, or the smallest, one query's heads, as a decode step wants.
    if layout.batch_invariant:
        block_m = max(16, _pow2(G), cfg.attn_invariant_block_m or 0)
    else:
        block_m = max(16, min(_pow2(max(1, per_req) * G), max_m))
    on_path = layout.batch_invariant and tree is not None
    block_q = 1 if on_path else max(1, block_m // G)
    tiles = plan.tiles(block_q)
    num_tiles = tiles.req.shape[0]
    block_d = max(16, _pow2(d))
    # One query per request (decode) and tree verify split like decode (bench/bench_attention_verify.py);
    # never in the batch-invariant mode, where decode and verify must walk the keys in the same blocks
    # and fixed chunks. Their short tiles read more keys a step, and so do every one of that mode's
    # (one query's heads, or a few queries): a split of attn_invariant_keys = 128 is one step, and a
    # program that folds its splits walks as many steps as the default mode's.
    decode = tree is None and per_req == 1 and not layout.batch_invariant
    few_queries = decode or (tree is not None and not layout.batch_invariant)
    block_n = cfg.attn_block_n(d, q.element_size(), short_tiles=few_queries or layout.batch_invariant)
    max_kv = max(1, min(layout.max_kv_len, layout.req_to_token.shape[1]))
    min_split = cfg.attn_split_keys(block_n, few_queries)
    want = cfg.attn_programs if cfg.attn_programs is not None else num_programs_to_fill(q.device)
    if layout.batch_invariant:
        # Key chunks at fixed positions: a query's reduction order depends on its own length only.
        chunk = cfg.attn_invariant_keys or min_split
    else:
        splits = 1
        if num_tiles * H < want and max_kv > min_split:
            splits = min(-(-want // (num_tiles * H)), -(-max_kv // min_split))
        chunk = -(-max_kv // splits)
    chunk = -(-chunk // block_n) * block_n
    splits = -(-max_kv // chunk)
    even = cfg.attn_even_split and not layout.batch_invariant
    if even:
        # Each request's keys are shared evenly by the splits in the kernel; at least min_split each.
        chunk = min(chunk, -(-min_split // block_n) * block_n)
    shared_prefix = on_path and splits > 1
    first_tiles = plan.tiles(max(1, block_m // G)) if shared_prefix else tiles
    # The batch-invariant mode folds the splits in the attention kernel (one program per tile and
    # head walks them all) where its first launch's tiles x heads fill the device
    # attn_invariant_fold times over; fewer take the splits in parallel and a merge folds them.
    fold = (layout.batch_invariant and splits > 1 and cfg.attn_invariant_fold is not None
            and first_tiles.req.shape[0] * H >= want * cfg.attn_invariant_fold)
    mid_o = mid_m = mid_w = fold_m = fold_w = fold_o = out
    if splits > 1 and not fold:
        mid_o = torch.empty((splits, N, Hq, d), dtype=torch.float32, device=q.device)
        mid_m = torch.empty((splits, N, Hq), dtype=torch.float32, device=q.device)
        mid_w = torch.empty((splits, N, Hq), dtype=torch.float32, device=q.device)
    if fold and shared_prefix:
        fold_m = torch.empty((N, Hq), dtype=torch.float32, device=q.device)
        fold_w = torch.empty((N, Hq), dtype=torch.float32, device=q.device)
        fold_o = torch.empty((N, Hq, d), dtype=torch.float32, device=q.device)
    mask = tree.view(torch.uint8) if tree is not None else plan.q_lens
    k_layer, v_layer = kv.k[layer], kv.v[layer]

    def launch(tiles: _Tiles, path: bool, part: int, tree_d: int = tree_d) -> None:
        # One program per split, except in the batch-invariant mode, where the splits follow the
        # host's bound on the keys: there each tile and head takes them in one program that folds
        # them (fold), or in as many programs as fill the device attn_invariant_fill times, each
        # program every so-many-th split (the merge order is the splits' own).
        programs = splits
        if fold:
            programs = 1
        elif layout.batch_invariant:
            programs = min(splits, max(1, -(-want * cfg.attn_invariant_fill // (tiles.req.shape[0] * H))))
        attention_kernel[(tiles.req.shape[0], H, programs)](
            q, k_layer, v_layer, out, mid_o, mid_m, mid_w, fold_m, fold_w, fold_o,
            layout.req_to_token, layout.req_pool_indices, layout.kv_lens, plan.q_lens, plan.q_start,
            plan.q_lens if layout.q_active is None else layout.q_active,
            tiles.req, tiles.q0, mask, plan.path(tree) if path else plan.q_lens,
            B, layout.req_to_token.shape[0], layout.req_to_token.shape[1], kv.num_slots, N,
            k_layer.stride(0), sm_scale * _LOG2E, chunk, splits,
            Hq=Hq, H=H, HEAD_DIM=d, TREE_D=tree_d, BLOCK_Q=tiles.block_q, BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_D=block_d, SPLIT=splits > 1, EVEN=even, PATH=path, PART=part, FOLD=fold,
            ACTIVE=layout.q_active is not None, IEEE=q.dtype == torch.float32,
            UPCAST=q.dtype == torch.bfloat16 and interpreting(),
            num_warps=cfg.attn_num_warps(block_m, block_d), num_stages=cfg.attn_stages(decode),
            **pdl_keywords(cfg.pdl), **cfg.options())

    if shared_prefix:
        # The splits wholly before the tree hold keys every node sees at the positions a decode
        # query reads them: a tile of nodes reads them once, in the decode kernel itself (no tree
        # mask: every key there is visible), so each row's bits are a decode query's; each node on
        # its path reads the rest (folding on from where the first launch left its rows).
        launch(first_tiles, False, 1, tree_d=0)
        launch(tiles, True, 2)
    else:
        launch(tiles, on_path, 0)
    if splits > 1 and not fold:
        # As many rows a program as keep the programs filling the device, up to 16. Programs of several
        # rows skip the empty splits' outputs (H200, a 16-node verify step at batch 16: the merges
        # 0.76x as long; one-row programs, decode at batch 16, were 1.14x with it).
        block_r = min(16, pow2_floor(N * Hq // want))
        merge_kernel[(-(-N * Hq // block_r),)](mid_o, mid_m, mid_w, out, N * Hq, splits, HEAD_DIM=d, BLOCK_R=block_r,
                                               BLOCK_S=min(16, _pow2(splits)), BLOCK_D=block_d, SKIP_EMPTY=block_r > 1,
                                               num_warps=cfg.num_warps, **pdl_keywords(cfg.pdl), **cfg.options())
    return out


class TritonAttentionOps:
    """Mixin: the attention kernels as the ``_<op>`` of :class:`~ngram_hal.backend.Backend` (which
    has validated the arguments), launched with the backend's ``launch``."""

    def _attention_layout(self, *args):
        return attention_layout(*args, self.launch)

    def _attention(self, *args):
        return attention(*args, self.launch)

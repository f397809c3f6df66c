"""Reference paged attention: queries in fixed-size blocks, keys gathered per block, masked SDPA.

Every block holds up to ``Bq`` consecutive queries of one request and reads that request's keys,
padded to ``max_kv_len``. Block size and count are host ints derived from shapes only, so nothing
is read back to the host. :func:`layout` builds the blocks once per batch (the backend keeps them
as the plan of an :class:`ngram_hal.AttentionLayout`); :func:`attention` runs one layer:

* tree verify (``tree_mask`` given): one block of ``D`` queries per request, exact;
* one block per request of ``min(N, max_kv_len)`` queries when that pads at most half the rows
  (prefill of similar lengths);
* otherwise blocks of ``ceil(N / B)`` queries: at most about twice the rows and twice the key
  gathers of a ragged kernel, whatever the mix of decodes and extends;
* a batch-invariant layout: one block per query, whose keys are the ones a decode of that query
  reads, in the columns a decode reads them: a causal query's first ``position + 1`` keys; a tree
  node's prefix, then its ancestors and itself in depth order (where they sit once accepted). Every
  block has ``max_kv_len`` key columns, so a query's scores, softmax and sums have the same shapes
  and order whatever else shares the call, and a tree node computes exactly what the decode of
  its path computes once that path is accepted.

Blocks run in chunks that keep the gathered keys and the scores within :data:`CHUNK_BYTES`. On
the CPU, blocks of one query (decode steps, and every block of a batch-invariant layout) run
through a compiled kernel that computes each query alone (:mod:`ngram_hal.kernels.cpu.attention`):
with a float32 cache it reads each key where it lies; a half-precision cache's keys are gathered
and widened first. torch's batched products may round a block otherwise in a call of another
block count (MKL on an AVX-512 CPU does), so a batch-invariant layout never runs through them on
the CPU.
Arguments are validated by :class:`ngram_hal.Backend` before these functions run. Values the
contract forbids (checked only in strict mode) are masked as a kernel would mask them: negative
``q_lens`` count as 0, queries past the runs (or past what a request's blocks hold) read as
zeros, a request row outside ``req_to_token`` and a slot outside the cache read no key. Such a
call computes garbage for the requests concerned, but never reads or writes outside a tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ..kernels.cpu.attention import KERNEL_QUERIES, attend
from ..kv_cache import KVCache
from .ragged import flatten, within

if TYPE_CHECKING:
    from ..layout import AttentionLayout

CHUNK_BYTES = 64 << 20


@dataclass
class _Blocks:
    """G blocks of Bq query rows. ``flat[n]``: row of query n in the padded [G*Bq] layout;
    ``req[g]``: the request block g reads (its keys); ``mask``: bool[G, Bq, T]; ``cols``:
    int64[G, T], the ``req_to_token`` column each key column reads (None: column t reads t)."""

    size: int
    flat: torch.Tensor
    req: torch.Tensor
    mask: torch.Tensor
    cols: torch.Tensor | None = None


def _tree_blocks(tree_mask: torch.Tensor, prefix: torch.Tensor, cols: torch.Tensor) -> _Blocks:
    """One block per request: node i sees the whole prefix and, in the block, its tree ancestors."""
    B, D, _ = tree_mask.shape
    T = cols.shape[0]
    rel = cols - prefix.unsqueeze(1)
    in_block = (rel >= 0) & (rel < D)
    seen = torch.gather(tree_mask, 2, rel.clamp(0, D - 1).unsqueeze(1).expand(B, D, T))
    mask = (rel < 0).unsqueeze(1) | (in_block.unsqueeze(1) & seen)
    dev = tree_mask.device
    return _Blocks(D, torch.arange(B * D, dtype=torch.int64, device=dev),
                   torch.arange(B, dtype=torch.int64, device=dev), mask)


def _causal_blocks(kv_lens: torch.Tensor, q_lens: torch.Tensor, N: int, cols: torch.Tensor) -> _Blocks:
    """Blocks of consecutive queries of one request; query at position p sees keys ``<= p``.

    A query that fits no block (past the runs of ``q_lens``, or of a request with more queries
    than its blocks hold) maps to the scratch row ``count * size`` and sees no key.
    """
    B, T, dev = kv_lens.shape[0], cols.shape[0], kv_lens.device
    q_max = min(N, T)
    if B * q_max <= 2 * N:
        size, count = q_max, B
    else:
        size = -(-N // B)
        # sum_b ceil(q_b / size) <= floor((N + B * (size - 1)) / size), and no more blocks than queries.
        count = min(N, (N + B * (size - 1)) // size)
    flat = flatten(q_lens, N)
    req, row = flat.run, flat.offset
    per_req = (flat.lengths + size - 1) // size
    block = flat.per_run(torch.cumsum(per_req, 0) - per_req) + row // size
    slot = row % size
    placed = flat.inside & (block < count)
    block = torch.where(placed, block, count)
    # Scatters write one scratch entry past the last block for the queries that fit none.
    block_req = torch.zeros(count + 1, dtype=torch.int64, device=dev).scatter_(0, block, req.clamp(max=B - 1))[:count]
    used = torch.zeros(count + 1, dtype=torch.bool, device=dev).scatter_(0, block, placed)[:count]
    start = flat.per_run(kv_lens - flat.lengths) + row - slot
    first_pos = torch.zeros(count + 1, dtype=torch.int64, device=dev).scatter_(0, block, start)[:count]
    length = torch.where(used, kv_lens.index_select(0, block_req), 0)
    pos = first_pos.unsqueeze(1) + torch.arange(size, dtype=torch.int64, device=dev)
    mask = (cols <= pos.unsqueeze(2)) & (cols < length.view(count, 1, 1))
    return _Blocks(size, torch.where(placed, block * size + slot, count * size), block_req, mask)


def _path_blocks(tree_mask: torch.Tensor, prefix: torch.Tensor, cols: torch.Tensor) -> _Blocks:
    """One block per tree node: the prefix, then the node's ancestors and itself in depth order
    (BFS order puts an ancestor before its descendants, so index order is depth order)."""
    B, D, _ = tree_mask.shape
    dev = tree_mask.device
    nodes = torch.arange(D, dtype=torch.int64, device=dev)
    rank = torch.cumsum(tree_mask.long(), 2) - 1
    # path[b, i, k]: the k-th node of node i's path; entries off the path land in a spare column.
    path = torch.zeros(B, D, D + 1, dtype=torch.int64, device=dev).scatter_(
        2, torch.where(tree_mask, rank, D), nodes.expand(B, D, D))[:, :, :D]
    depth = rank[:, :, -1:]
    rel = (cols - prefix.unsqueeze(1)).unsqueeze(1)
    on_path = (rel >= 0) & (rel <= depth)
    node = torch.gather(path, 2, rel.clamp(0, D - 1).expand(B, D, -1))
    read = torch.where(on_path, prefix.view(B, 1, 1) + node, cols)
    mask = (rel < 0) | on_path
    T = cols.shape[0]
    requests = torch.arange(B, dtype=torch.int64, device=dev).repeat_interleave(D)
    return _Blocks(1, torch.arange(B * D, dtype=torch.int64, device=dev), requests, mask.view(B * D, 1, T),
                   read.view(B * D, T))


def _query_blocks(kv_lens: torch.Tensor, q_lens: torch.Tensor, N: int, cols: torch.Tensor) -> _Blocks:
    """One block per causal query: the keys up to its own position. A query past the runs of
    ``q_lens`` sees no key."""
    B = kv_lens.shape[0]
    flat = flatten(q_lens, N)
    pos = flat.per_run(kv_lens - flat.lengths, fill=-1) + flat.offset
    length = flat.per_run(kv_lens)
    mask = (cols <= pos.unsqueeze(1)) & (cols < length.unsqueeze(1)) & flat.inside.unsqueeze(1)
    return _Blocks(1, flat.index, flat.run.clamp(max=B - 1), mask.unsqueeze(1))


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sm_scale: float,
          invariant: bool = False) -> torch.Tensor:
    """Grouped-query SDPA. q [G, Qg, Hq, d]; k, v [G, T, H, d]; mask bool [G, Qg, T] -> [G, Qg, Hq, d].

    ``invariant``: products of contiguous blocks, softmax and products again, which compute each
    block alone (torch's fused SDPA on a CPU, or a product over a strided view, can give a block
    other bits in a call of another block count)."""
    G, Qg, Hq, d = q.shape
    T, H = k.shape[1], k.shape[2]
    g = Hq // H
    qh = q.reshape(G, Qg, H, g, d).permute(0, 2, 3, 1, 4).reshape(G, H, g * Qg, d)
    m = mask[:, None, None].expand(G, 1, g, Qg, T).reshape(G, 1, g * Qg, T)
    kh, vh = k.transpose(1, 2), v.transpose(1, 2)
    if invariant:
        qh, kh, vh = qh.contiguous(), kh.contiguous(), vh.contiguous()
        scores = torch.matmul(qh, kh.transpose(2, 3)).mul_(sm_scale).masked_fill_(~m, -math.inf)
        out = torch.matmul(torch.softmax(scores, -1), vh)
    else:
        out = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=m, scale=sm_scale)
    return out.reshape(G, H, g, Qg, d).permute(0, 3, 1, 2, 4).reshape(G, Qg, Hq, d)


class Plan:
    """The blocks of one batch and the KV rows (int64[G, T]) each block reads, -1 where a block
    reads no key; :meth:`rows` maps those, and any slot outside the cache, to the cache's
    scratch row, once per cache. ``invariant``: the blocks of a batch-invariant layout.
    ``idle``: bool[N], the queries the layout's ``q_active`` leaves out (None: none)."""

    def __init__(self, blocks: _Blocks, slots: torch.Tensor, invariant: bool = False,
                 idle: torch.Tensor | None = None):
        self.blocks = blocks
        self.slots = slots
        self.invariant = invariant
        self.idle = idle
        self._rows: tuple[int, torch.Tensor] | None = None

    def rows(self, scratch: int) -> torch.Tensor:
        if self._rows is None or self._rows[0] != scratch:
            self._rows = (scratch, torch.where(within(self.slots, scratch), self.slots, scratch))
        return self._rows[1]


def layout(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, kv_lens: torch.Tensor,
           q_lens: torch.Tensor, tree_mask: torch.Tensor | None, N: int, max_kv_len: int,
           batch_invariant: bool = False, q_active: torch.Tensor | None = None) -> Plan | None:
    """The blocks of one batch; None when there is nothing to attend to (no query, key or request).
    The queries ``q_active`` leaves out are computed like the others, then zeroed.

    A block of a request whose ``req_pool_indices`` entry lies outside ``req_to_token`` reads no key.
    """
    R, M = req_to_token.shape
    T = min(max_kv_len, M)
    B = req_pool_indices.shape[0]
    if N == 0 or T <= 0 or B == 0 or R == 0:
        return None
    cols = torch.arange(T, dtype=torch.int64, device=req_to_token.device)
    if tree_mask is not None:
        blocks = (_path_blocks if batch_invariant else _tree_blocks)(tree_mask, kv_lens - q_lens, cols)
    elif batch_invariant:
        blocks = _query_blocks(kv_lens, q_lens, N, cols)
    else:
        blocks = _causal_blocks(kv_lens, q_lens, N, cols)
    table_row = req_pool_indices.index_select(0, blocks.req)
    readable = blocks.mask.any(1) & within(table_row, R).unsqueeze(1)
    slots = req_to_token[:, :T].index_select(0, table_row.clamp(0, R - 1))
    if blocks.cols is not None:
        slots = torch.gather(slots, 1, blocks.cols.clamp(0, T - 1))
    idle = None
    if q_active is not None:
        # A query's place in its request against the request's count; queries of no request read as zeros anyway.
        flat = flatten(q_lens, N)
        idle = flat.offset >= flat.per_run(q_active)
    return Plan(blocks, torch.where(readable, slots, -1), batch_invariant, idle)


def in_place(q_pad: torch.Tensor, kv: KVCache, plan: Plan) -> bool:
    """Whether the blocks run through the compiled kernel that reads keys where they lie
    (:func:`~ngram_hal.kernels.cpu.attention.attend`): float32 on the CPU, blocks of at most
    :data:`~ngram_hal.kernels.cpu.attention.KERNEL_QUERIES` queries (decode steps, and every block
    of a batch-invariant layout)."""
    return (q_pad.device.type == "cpu" and q_pad.dtype == torch.float32 and kv.dtype == torch.float32
            and plan.blocks.size <= KERNEL_QUERIES)


def attention(q: torch.Tensor, kv: KVCache, layer: int, plan: Plan | None, sm_scale: float) -> torch.Tensor:
    """Paged attention; see :meth:`ngram_hal.Backend.attention` for the contract.

    Args:
        q: float[N, Hq, d]. plan: what :func:`layout` built for this batch.
    Returns:
        float[N, Hq, d] in q's dtype. Half-precision inputs are computed in float32.
    """
    N, Hq, d = q.shape
    if plan is None:
        return torch.zeros_like(q)
    blocks, rows = plan.blocks, plan.rows(kv.num_slots)
    T = rows.shape[1]
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    G, Bq = blocks.req.shape[0], blocks.size
    # Blocks are laid out in query order, so when they hold exactly N rows the layout is the identity.
    dense = G * Bq == N
    qw = q if q.dtype == work else q.to(work)
    # Off the identity layout, one scratch row past the blocks takes the queries that fit no block
    # (in and out; it reads as zeros).
    spare = 0 if dense else 1
    if dense:
        q_pad = qw.view(G, Bq, Hq, d)
    else:
        q_pad = q.new_zeros(G * Bq + 1, Hq, d, dtype=work).index_copy_(0, blocks.flat, qw)[:G * Bq].view(G, Bq, Hq, d)
    out_rows = torch.empty(G * Bq + spare, Hq, d, dtype=work, device=q.device)
    out_rows[G * Bq:] = 0
    out = out_rows[:G * Bq].view(G, Bq, Hq, d)
    if in_place(q_pad, kv, plan):
        attend(q_pad, kv.k[layer], kv.v[layer], rows, blocks.mask, sm_scale, out)
    else:
        H, elt = kv.num_heads, torch.empty((), dtype=work).element_size()
        chunk = max(1, CHUNK_BYTES // (T * elt * (2 * H * d + Hq * Bq)))
        for s in range(0, G, chunk):
            e = min(G, s + chunk)
            r = rows[s:e].reshape(-1)
            k = kv.k[layer].index_select(0, r).view(e - s, T, H, d)
            v = kv.v[layer].index_select(0, r).view(e - s, T, H, d)
            if k.dtype != work:
                k, v = k.to(work), v.to(work)
            if plan.invariant and q.device.type == "cpu":
                # The compiled kernel over the widened copies: key column t of block g is row g * T + t.
                read = torch.arange((e - s) * T, dtype=torch.int64).view(e - s, T)
                attend(q_pad[s:e], k.view(-1, H, d), v.view(-1, H, d), read, blocks.mask[s:e], sm_scale, out[s:e])
            else:
                out[s:e] = _sdpa(q_pad[s:e], k, v, blocks.mask[s:e], sm_scale, plan.invariant)
    out = out_rows if dense else out_rows.index_select(0, blocks.flat)
    if plan.idle is not None:
        out = out.masked_fill(plan.idle[:, None, None], 0.0)
    return out if out.dtype == q.dtype else out.to(q.dtype)


class CpuAttentionOps:
    """Mixin: the reference's attention, bound as the ``_attention_layout`` and ``_attention`` of
    :class:`~ngram_hal.backend.Backend` (which has validated their arguments)."""

    def _attention_layout(self, built: AttentionLayout) -> Plan:
        return layout(built.req_to_token, built.req_pool_indices, built.kv_lens, built.q_lens,
                      built.tree_mask, built.num_queries, built.max_kv_len, built.batch_invariant, built.q_active)

    def _attention(self, q, kv_cache, layer, built: AttentionLayout, sm_scale):
        return attention(q, kv_cache, layer, built.plan, sm_scale)

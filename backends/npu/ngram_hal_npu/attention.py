"""Paged attention for Ascend in device-generic torch: every query against its request's keys.

The layout (built once per forward, shared by every layer) holds, for the batch's B requests and
T = ``max_kv_len`` key positions, the slot of each request's position t and, for each of the N
queries, its request and which of the T positions it sees (causal, or the tree mask inside the
block of new positions; none for the queries the layout's ``q_active`` leaves out). A layer then
gathers the B x T key and value rows once (int32 row indices, slots outside the cache read the
scratch row), hands each query its request's rows and runs two batched matrix products with a
float32 softmax between them, in chunks of queries that keep the gathered rows within
:data:`CHUNK_BYTES`.

Every shape is a host int (N, B, T), so a forward can be captured in an NPU graph. A query that
sees no key (possible only with invalid input) gets zeros. Arguments were validated by
:class:`ngram_hal.Backend`.
"""

from __future__ import annotations

import torch

from ngram_hal.contract import SENTINEL
from ngram_hal.kv_cache import KVCache
from ngram_hal.layout import AttentionLayout

from .indices import narrow, runs, take

CHUNK_BYTES = 64 << 20


class Plan:
    """One batch's key slots and query visibility, as :func:`layout` builds them.

    Attributes:
        slots: int64[B, T], ``req_to_token[r_b, t]``, -1 past ``kv_lens[b]``.
        query_req: int64[N], the request of each query.
        visible: bool[N, T], the key positions each query may attend to.
    """

    def __init__(self, slots: torch.Tensor, query_req: torch.Tensor, visible: torch.Tensor):
        self.slots = slots
        self.query_req = query_req
        self.visible = visible
        self._rows: tuple[int, torch.Tensor, torch.Tensor] | None = None

    def rows(self, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """int32[B*T] cache rows to gather (the scratch row ``num_slots`` where a slot is -1 or
        outside the cache) and bool[B, T], which of them hold a key; built once per cache size."""
        if self._rows is None or self._rows[0] != num_slots:
            ok = (self.slots >= 0) & (self.slots < num_slots)
            rows = narrow("attention", "req_to_token", torch.where(ok, self.slots, num_slots).reshape(-1),
                          num_slots + 1)
            self._rows = (num_slots, rows, ok)
        return self._rows[1], self._rows[2]


def layout(layout: AttentionLayout) -> Plan:
    """The :class:`Plan` of one batch (see :meth:`ngram_hal.Backend.attention_layout`)."""
    op = "attention"
    req_to_token, kv_lens, q_lens = layout.req_to_token, layout.kv_lens, layout.q_lens
    N = layout.num_queries
    M = req_to_token.shape[1]
    T = min(layout.max_kv_len, M)
    device = kv_lens.device
    t = torch.arange(T, dtype=torch.int64, device=device)
    in_len = t < kv_lens.unsqueeze(1)
    cells = torch.where(in_len, layout.req_pool_indices.unsqueeze(1) * M + t, SENTINEL)
    slots = torch.where(in_len, take(op, "req_pool_indices", req_to_token.view(-1), cells.clamp(min=0)), SENTINEL)
    query_req, row = runs(op, q_lens, N)
    prefix = take(op, "q_lens", kv_lens - q_lens, query_req).unsqueeze(1)
    seen = take(op, "q_lens", in_len, query_req)
    if layout.tree_mask is None:
        visible = seen & (t <= prefix + row.unsqueeze(1))
    else:
        D = layout.tree_mask.shape[1]
        node_mask = take(op, "tree_mask", layout.tree_mask.view(-1, D), query_req * D + row)
        rel = t - prefix
        in_block = (rel >= 0) & (rel < D)
        queries = torch.arange(N, dtype=torch.int64, device=device).unsqueeze(1) * D
        in_tree = take(op, "tree_mask", node_mask.reshape(-1), queries + rel.clamp(0, max(D - 1, 0)))
        visible = seen & ((rel < 0) | (in_block & in_tree))
    if layout.q_active is not None:
        # The queries q_active leaves out see no key: zero rows.
        visible = visible & (row < take(op, "q_active", layout.q_active, query_req)).unsqueeze(1)
    return Plan(slots, query_req, visible)


def attention(q: torch.Tensor, kv: KVCache, layer: int, plan: Plan, sm_scale: float) -> torch.Tensor:
    """Paged attention of one layer (see :meth:`ngram_hal.Backend.attention`).

    Args:
        q: float[N, Hq, d] of the cache's dtype. plan: from :func:`layout`.
    Returns:
        float[N, Hq, d] in q's dtype; float32 scores, softmax and accumulation.
    """
    N, Hq, d = q.shape
    B, T = plan.slots.shape
    H = kv.num_heads
    G = Hq // H
    out = torch.zeros(N, Hq, d, dtype=q.dtype, device=q.device)
    if N == 0 or T == 0:
        return out
    rows, key_ok = plan.rows(kv.num_slots)
    keys = kv.k[layer].index_select(0, rows).view(B, T, H, d)
    values = kv.v[layer].index_select(0, rows).view(B, T, H, d)
    req = narrow("attention", "q_lens", plan.query_req, B)
    mask = plan.visible & key_ok.index_select(0, req)
    per_query = 4 * (2 * T * H * d + 2 * Hq * T)
    step = max(1, CHUNK_BYTES // per_query)
    for s in range(0, N, step):
        e = min(N, s + step)
        r = req[s:e]
        k = keys.index_select(0, r).float().permute(0, 2, 3, 1)      # [n, H, d, T]
        v = values.index_select(0, r).float().transpose(1, 2)        # [n, H, T, d]
        qg = q[s:e].float().view(e - s, H, G, d)
        scores = torch.matmul(qg, k) * sm_scale                      # [n, H, G, T]
        seen = mask[s:e].view(e - s, 1, 1, T)
        scores = scores.masked_fill(~seen, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        weights = torch.exp(scores - torch.where(torch.isfinite(top), top, 0.0))
        total = weights.sum(-1, keepdim=True)
        probs = weights / torch.where(total > 0, total, 1.0)
        out[s:e] = torch.matmul(probs, v).view(e - s, Hq, d).to(q.dtype)
    return out


class NpuAttentionOps:
    """Mixin: the NPU backend's attention, bound as the ``_attention_layout`` and ``_attention`` of
    :class:`~ngram_hal.backend.Backend` (which has validated their arguments)."""

    def _attention_layout(self, built: AttentionLayout) -> Plan:
        return layout(built)

    def _attention(self, q, kv_cache, layer, built: AttentionLayout, sm_scale):
        return attention(q, kv_cache, layer, built.plan, sm_scale)

"""Decode and verify forwards captured once per batch bucket and tree size, then replayed.

A decode step with B requests and n tree nodes each runs the model over ``B*n`` rows. Its shapes
are fixed by ``(B, n)``; every size that depends on data is given a bound instead (attention reads
keys up to the request table's width, which bounds every ``kv_len``), so one captured graph serves
every step of that shape. Batches are padded up to the next bucket: padding requests read no keys
(``kv_len`` 0) and store no K/V (slot -1), and their logits are ignored.

Capture and replay go through the backend's runtime (``graph_capture``, ``new_graph``,
``capture``), never a vendor module. Where the runtime cannot capture (the CPU), :class:`StepGraphs`
is not used.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .model import ForwardBatch, LlamaModel
from ..memory.kv_cache import KVCache


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then steps of 8 up to 64, of 32 beyond; the last is ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 32)
    return sizes + [max_batch]


@dataclass
class _Entry:
    """The static inputs of one captured shape, its graph and its output (float32[Bp*n, V])."""

    batch: ForwardBatch
    graph: object
    logits: torch.Tensor


class StepGraphs:
    """Captured forwards of decode and verify steps.

    Args:
        model: the target model (its backend's runtime must offer graph capture).
        kv: the KV cache the steps write.
        req_to_token: the request table every step reads (int64[R, M]; M bounds ``kv_lens``).
        max_batch: the most requests one step holds.
    """

    def __init__(self, model: LlamaModel, kv: KVCache, req_to_token: torch.Tensor, max_batch: int):
        runtime = model.backend.runtime
        if not runtime.graph_capture:
            raise ValueError(f"graph capture is not available on {model.device}")
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.runtime = runtime
        self.buckets = batch_buckets(max_batch)
        self.pool = runtime.new_graph_pool()
        self._entries: dict[tuple[int, int], _Entry] = {}
        self.captures = 0

    def bucket(self, batch_size: int) -> int:
        """The padded batch size for ``batch_size`` requests."""
        for b in self.buckets:
            if b >= batch_size:
                return b
        raise ValueError(f"batch of {batch_size} requests exceeds max_batch {self.buckets[-1]}")

    def capture_all(self, node_sizes) -> None:
        """Capture every batch bucket for each tree size in ``node_sizes`` now, so that no step
        pays a capture (kernel compilation included) later."""
        for nodes in node_sizes:
            for padded in self.buckets:
                self._entry(padded, nodes)

    def forward(self, batch: ForwardBatch, nodes: int) -> torch.Tensor:
        """The logits of ``batch`` (B requests of ``nodes`` rows each, tree mask given when
        ``nodes > 1``): float32[B*nodes, V], a view valid until the next call with the same shape."""
        B = batch.req_pool_indices.shape[0]
        N = B * nodes
        padded = self.bucket(B)
        entry = self._entry(padded, nodes)
        s = entry.batch
        s.input_ids[:N].copy_(batch.input_ids)
        s.positions[:N].copy_(batch.positions)
        s.out_cache_loc[:N].copy_(batch.out_cache_loc)
        s.req_pool_indices[:B].copy_(batch.req_pool_indices)
        s.kv_lens[:B].copy_(batch.kv_lens)
        if nodes > 1:
            s.tree_mask[:B].copy_(batch.tree_mask)
        if B < padded:
            s.out_cache_loc[N:].fill_(-1)
            s.kv_lens[B:].fill_(0)
        entry.graph.replay()
        return entry.logits[:N]

    def _entry(self, padded: int, nodes: int) -> _Entry:
        """The captured graph of one shape, capturing it on first use. Capture runs on inputs that
        read no key and store no K/V, so it changes nothing in the cache."""
        key = (padded, nodes)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._static(padded, nodes)
            # An eager run first compiles the kernels and settles the allocations.
            self.model.forward(entry.batch, self.kv)
            self.runtime.synchronize()
            graph = self.runtime.new_graph()
            with self.runtime.capture(graph, pool=self.pool):
                entry.logits = self.model.forward(entry.batch, self.kv)
            entry.graph = graph
            self.captures += 1
            self._entries[key] = entry
        return entry

    def _static(self, padded: int, nodes: int) -> _Entry:
        dev, N = self.model.device, padded * nodes

        def index(n: int, fill: int) -> torch.Tensor:
            return torch.full((n,), fill, dtype=torch.int64, device=dev)

        tree_mask = None
        if nodes > 1:
            tree_mask = torch.eye(nodes, dtype=torch.bool, device=dev).expand(padded, nodes, nodes).contiguous()
        batch = ForwardBatch(input_ids=index(N, 0), positions=index(N, 0), out_cache_loc=index(N, -1),
                             req_to_token=self.req_to_token, req_pool_indices=index(padded, 0),
                             kv_lens=index(padded, 0), q_lens=index(padded, nodes), tree_mask=tree_mask,
                             max_kv_len=self.req_to_token.shape[1], logits_index=None)
        return _Entry(batch, None, None)

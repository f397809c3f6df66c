"""Decode and verify steps captured once per batch bucket and tree size, then replayed.

A decode step with B requests and n tree nodes each runs the model over ``B*n`` rows. Its shapes
are fixed by ``(B, n)``; every size that depends on data is given a bound instead (attention reads
keys up to the request table's width, which bounds every ``kv_len``), so one captured graph serves
every step of that shape. Batches are padded up to the next bucket.

Two kinds of graph:

* a **greedy step** (:class:`GreedyStep`): the whole verify step of greedy requests
  (:func:`~ngram_hal.engine.verify_step.verify_step`, as eager steps run it), from the tree's
  tokens, mask, rows and lengths to the committed tokens: retrieve links, cache locations, the
  model forward, greedy verify and the KV compaction, about ten launches of the
  HAL's ops and the model's few hundred kernels in one replay. Padding requests store no K/V (their
  cache locations are forced to -1), so every move they produce has a -1 source and does nothing.
  With a device drafter the step also records its committed tokens and drafts the next step's
  chains (:meth:`~ngram_hal.speculative.lookup.DeviceDrafter.draft_next`; the padding records
  nothing), and its tree masks are fixed chains.
* a **forward** (:meth:`StepGraphs.forward`): the model forward alone, for steps that sample or
  want log-probabilities; padding requests read no keys (``kv_len`` 0) and store no K/V.
* a **prefill** of the few requests admitted together (:class:`PaddedPrefill`, up to
  :data:`PREFILL_BATCH`), padded to a batch bucket and a length bucket (:func:`prefill_bucket` of their tokens together): the padding
  tokens follow the last prompt, so causal attention keeps them out of every real row, and they
  store no K/V; padding requests have no tokens. Without it a prefill is a few hundred eager
  launches whose host time, not the device, sets its cost: on an H200, 25 ms for four prompts of
  2,234 tokens, against 2.9 ms for a captured prefill of two prompts of 1,235.

Capture and replay go through the backend's runtime (``graph_capture``, ``new_graph``,
``capture``), never a vendor module. Where the runtime cannot capture (the CPU), :class:`StepGraphs`
is not used; :class:`GreedyStep` also runs eagerly, which is how its padding is tested there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch

from ..kv_cache import KVCache
from ..speculative.lookup import DeviceDrafter, chain_masks
from ..speculative.relay import OverlapRelay
from .model import ForwardBatch, LlamaModel
from .verify_step import verify_step


def batch_buckets(max_batch: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, then steps of 8 up to 64, of 32 beyond; the last is ``max_batch``."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b = b * 2 if b < 8 else b + (8 if b < 64 else 32)
    return sizes + [max_batch]


def _index(n: int, fill: int, device) -> torch.Tensor:
    """A static int64[n] input buffer holding ``fill``."""
    return torch.full((n,), fill, dtype=torch.int64, device=device)


def _identity_masks(padded: int, tree_size: int, device) -> torch.Tensor:
    """A static bool[padded, n, n] tree-mask buffer (n = ``tree_size``) holding identities (trees of roots)."""
    return torch.eye(tree_size, dtype=torch.bool, device=device).expand(padded, tree_size, tree_size).contiguous()


def prefill_bucket(num_tokens: int) -> int:
    """Padded length of a prefill of ``num_tokens`` prompt tokens: the next power of two from 16
    up to 512, then the next multiple of 512."""
    if num_tokens <= 512:
        return max(16, 1 << (num_tokens - 1).bit_length())
    return -(-num_tokens // 512) * 512


def prefill_lengths(limit: int) -> list[int]:
    """Every padded length :func:`prefill_bucket` gives up to ``limit`` tokens."""
    lengths, n = [], 16
    while n <= limit:
        lengths.append(n)
        n = n * 2 if n < 512 else n + 512
    return lengths


PREFILL_BATCH = 4
"""The most requests a captured prefill holds. Where steps are captured no admission takes more
(:attr:`Scheduler.prefill_cap <ngram_hal.engine.scheduler.Scheduler.prefill_cap>`): a batch's
first fill is a few such prefills in a row, since one eager prefill of thousands of tokens (a few
hundred launches) takes several times as long as the captured prefills that hold the same tokens."""


class PaddedPrefill:
    """The static inputs and the forward of a prefill of up to ``batch`` requests and ``padded`` tokens.

    :meth:`load` copies B prompts' tokens, cache locations and request rows in; :meth:`run`
    returns the logits of each request's last token. The padding tokens follow the last prompt
    as part of its request (so causal attention never lets a real row see them), store nothing
    (location -1) and read whatever that request's table row holds past its prompt (a slot or
    -1; their output is unused). Padding requests past the B real ones have no queries and no
    keys. The host-side lengths travel in one upload into one buffer that the forward's index
    tensors are views of.
    """

    def __init__(self, model: LlamaModel, kv: KVCache, req_to_token: torch.Tensor, batch: int, padded: int):
        if padded > req_to_token.shape[1]:
            raise ValueError(f"padded: {padded} tokens exceed the request table's {req_to_token.shape[1]} positions")
        self.model, self.kv, self.padded, self.size = model, kv, padded, batch
        dev = model.device
        # positions[padded], then per request: rows, kv_lens (= q_lens), logits_index.
        self.meta = _index(padded + 3 * batch, 0, dev)
        positions, rows, lens, last = self.meta.split([padded, batch, batch, batch])
        # Until the first load, request 0 holds every token (as a capture's first run needs: every row is a query).
        positions.copy_(torch.arange(padded, dtype=torch.int64, device=dev))
        lens[:1].fill_(padded)
        self.batch = ForwardBatch(
            input_ids=_index(padded, 0, dev), positions=positions, out_cache_loc=_index(padded, -1, dev),
            req_to_token=req_to_token, req_pool_indices=rows, kv_lens=lens, q_lens=lens, tree_mask=None,
            max_kv_len=padded, logits_index=last)

    def load(self, input_ids: torch.Tensor, out_cache_loc: torch.Tensor, rows: torch.Tensor, lens: list[int],
             upload) -> None:
        """Copy in B prompts one after another: input_ids and out_cache_loc int64[N] (N =
        ``sum(lens)`` <= padded), rows int64[B] (B <= the batch size), ``lens`` the prompts'
        lengths on the host; ``upload`` copies a host list of ints to the device."""
        N, B, s = input_ids.shape[0], rows.shape[0], self.batch
        if not 0 < N <= self.padded or sum(lens) != N:
            raise ValueError(f"input_ids: {N} tokens (prompts of {sum(lens)}) do not fit a prefill of {self.padded}")
        if not 0 < B <= self.size or len(lens) != B:
            raise ValueError(f"rows: {B} requests ({len(lens)} lengths) do not fit a prefill of {self.size}")
        pad, ends = self.padded - N, list(accumulate(lens))
        kv_lens = lens[:-1] + [lens[-1] + pad] + [0] * (self.size - B)
        positions = [p for n in kv_lens for p in range(n)]
        last = [e - 1 for e in ends] + [0] * (self.size - B)
        self.meta.copy_(upload(positions + [0] * self.size + kv_lens + last))  # rows: padding ones 0
        s.req_pool_indices[:B].copy_(rows)
        s.input_ids[:N].copy_(input_ids)
        s.out_cache_loc[:N].copy_(out_cache_loc)
        s.out_cache_loc[N:].fill_(-1)

    def run(self) -> torch.Tensor:
        """float32[batch, V]: the logits of each loaded prompt's last token (rows past B: padding)."""
        return self.model.forward(self.batch, self.kv)


class GreedyStep:
    """The static inputs and the computation of one greedy verify step of ``padded`` requests of
    tree size ``tree_size`` (n) each (``tree_size == 1``: a plain decode step).

    :meth:`load` copies a step's inputs in (the first B requests; the rest are padding) and
    :meth:`run` computes it; :meth:`result` is the relay of the B real requests. A captured graph
    replays :meth:`run` over the same buffers. With a ``drafter`` (a
    :class:`~ngram_hal.speculative.lookup.DeviceDrafter`) every tree is a chain and :meth:`run`
    ends by drafting the next step's chains.
    """

    def __init__(self, model: LlamaModel, kv: KVCache, req_to_token: torch.Tensor, padded: int, tree_size: int,
                 drafter: DeviceDrafter | None = None):
        self.model, self.kv, self.req_to_token = model, kv, req_to_token
        self.padded, self.tree_size, self.drafter = padded, tree_size, drafter
        dev = model.device
        self.tokens = _index(padded * tree_size, 0, dev)
        self.rows = _index(padded, 0, dev)
        self.seq_lens = _index(padded, 0, dev)
        self.count = _index(1, 0, dev)
        self.q_lens = _index(padded, tree_size, dev)
        self.active = _index(padded, tree_size, dev)
        self.tree_mask = (_identity_masks if drafter is None else chain_masks)(padded, tree_size, dev)
        self.slot = torch.arange(padded, dtype=torch.int64, device=dev)
        self.outputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def load(self, tokens: torch.Tensor, tree_mask: torch.Tensor | None, rows: torch.Tensor,
             seq_lens: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Copy in a step of B requests: tokens int64[B*n] or [B, n] (a view will do), tree_mask
        bool[B, n, n] (None when ``tree_size == 1``, and with a drafter, whose trees are chains), rows
        and seq_lens int64[B], and the trees' active nodes int64[B] (None: all n)."""
        B = rows.shape[0]
        self.tokens[:B * self.tree_size].view(B, self.tree_size).copy_(tokens.view(B, self.tree_size))
        if self.tree_size > 1 and self.drafter is None:
            self.tree_mask[:B].copy_(tree_mask)
        self.rows[:B].copy_(rows)
        self.seq_lens[:B].copy_(seq_lens)
        if active is None:
            self.active[:B].fill_(self.tree_size)
        else:
            self.active[:B].copy_(active)
        self.count.fill_(B)
        if B < self.padded:
            self.rows[B:].fill_(0)
            self.seq_lens[B:].fill_(0)
            self.active[B:].fill_(0)

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step over the loaded buffers: ``(accept_tokens[Bp*n], accept_lens[Bp], new_seq_lens[Bp])``."""
        n, r2t = self.tree_size, self.req_to_token
        live = (self.slot < self.count).unsqueeze(1).expand(self.padded, n).reshape(-1)
        relay, _ = verify_step(self.model.backend, lambda batch: self.model.forward_argmax(batch, self.kv), self.kv,
                               r2t, self.tokens, self.tree_mask, self.rows, self.seq_lens, self.q_lens, n, r2t.shape[1],
                               live=live, chains=self.drafter is not None,
                               active=self.active if n > 1 else None)
        if self.drafter is not None:
            self.drafter.draft_next(self.rows, relay, self.count)
        self.outputs = (relay.accept_tokens, relay.accept_lens, relay.new_seq_lens)
        return self.outputs

    def result(self, batch_size: int) -> OverlapRelay:
        """The relay of the first ``batch_size`` requests after :meth:`run` (views of its outputs)."""
        tokens, lens, seq_lens = self.outputs
        n = self.tree_size
        return OverlapRelay(tokens[:batch_size * n], lens[:batch_size], seq_lens[:batch_size], n)


@dataclass
class _Forward:
    """The static inputs of one captured forward, its graph and its output (float32[Bp*n, V])."""

    batch: ForwardBatch
    graph: object
    logits: torch.Tensor


class StepGraphs:
    """Captured decode and verify steps.

    Args:
        model: the target model (its backend's runtime must offer graph capture).
        kv: the KV cache the steps write.
        req_to_token: the request table every step reads (int64[R, M]; M bounds ``kv_lens``).
        max_batch: the most requests one step holds.
        drafter: a :class:`~ngram_hal.speculative.lookup.DeviceDrafter` whose next chains every
            greedy step drafts (every tree is then one of its chains), or None.
    """

    def __init__(self, model: LlamaModel, kv: KVCache, req_to_token: torch.Tensor, max_batch: int,
                 drafter: DeviceDrafter | None = None):
        runtime = model.backend.runtime
        if not runtime.graph_capture:
            raise ValueError(f"graph capture is not available on {model.device}")
        self.model = model
        self.kv = kv
        self.req_to_token = req_to_token
        self.drafter = drafter
        self.runtime = runtime
        self.buckets = batch_buckets(max_batch)
        self.pool = runtime.new_graph_pool()
        self._steps: dict[tuple[int, int], tuple[GreedyStep, object]] = {}
        self._forwards: dict[tuple[int, int], _Forward] = {}
        self._prefills: dict[tuple[int, int], tuple[PaddedPrefill, object, torch.Tensor]] = {}
        self.captures = 0

    def bucket(self, batch_size: int) -> int:
        """The padded batch size for ``batch_size`` requests."""
        for b in self.buckets:
            if b >= batch_size:
                return b
        raise ValueError(f"batch of {batch_size} requests exceeds max_batch {self.buckets[-1]}")

    def capture_all(self, tree_sizes) -> None:
        """Capture the greedy step of every batch bucket for each tree size in ``tree_sizes`` now,
        so that no greedy step pays a capture (kernel compilation included) later."""
        for tree_size in tree_sizes:
            for padded in self.buckets:
                self._step(padded, tree_size)

    def capture_forwards(self, tree_sizes) -> None:
        """Capture the forward of every batch bucket for each tree size in ``tree_sizes`` now (the
        steps that sample or want log-probabilities run it)."""
        for tree_size in tree_sizes:
            for padded in self.buckets:
                self._forward(padded, tree_size)

    def calibrate(self, costs, tree_sizes, contexts: Sequence[int] | None = None, replays: int = 3) -> None:
        """Time the captured greedy step of every batch bucket for each tree size in ``tree_sizes``
        at each context in ``contexts`` (keys per request; default an eighth and a half of the
        request table's width) and give each time to ``costs`` (a
        :class:`~ngram_hal.engine.policy.StepCosts`) as that key's calibration at that context.

        Each request of a replay reads its keys from slots of its own, as a served batch does, so
        that attention costs what it will; none is live (``count`` 0), so nothing is stored, moved
        or drafted. The request table's rows are lent for the replays and given back as they
        were. Must run before any step is loaded."""
        r2t = self.req_to_token
        R, M = r2t.shape
        contexts = [M // 8, M // 2] if contexts is None else list(contexts)
        room = M - max(tree_sizes)
        bad = [L for L in contexts if not 0 <= L <= room]
        if bad or not contexts:
            raise ValueError(f"contexts: expected keys from 0 to {room}, got {contexts}")
        rows = min(R, self.buckets[-1])
        dev = r2t.device
        lent = r2t[:rows].clone()
        L = max(contexts)
        r2t[:rows, :L] = (torch.arange(rows * L, dtype=r2t.dtype, device=dev) % self.kv.num_slots).view(rows, L)
        begin, end = self.runtime.new_event(enable_timing=True), self.runtime.new_event(enable_timing=True)
        try:
            for tree_size in tree_sizes:
                for padded in self.buckets:
                    step, graph = self._step(padded, tree_size)
                    step.rows.copy_(torch.arange(padded, dtype=torch.int64, device=dev) % rows)
                    step.count.fill_(0)
                    for context in contexts:
                        step.seq_lens.fill_(context)
                        graph.replay()
                        begin.record(self.runtime.current_stream())
                        for _ in range(replays):
                            graph.replay()
                        end.record(self.runtime.current_stream())
                        end.synchronize()
                        costs.calibrate(padded, tree_size, begin.elapsed_time(end) / 1e3 / replays, context)
                    step.rows.fill_(0)
                    step.seq_lens.fill_(0)
        finally:
            r2t[:rows].copy_(lent)

    def greedy_step(self, tokens: torch.Tensor, tree_mask: torch.Tensor | None, rows: torch.Tensor,
                    seq_lens: torch.Tensor, tree_size: int, active: torch.Tensor | None = None) -> OverlapRelay:
        """Replay the greedy verify step of B requests (see :meth:`GreedyStep.load`); the relay
        it returns is a view valid until the next step of the same shape."""
        B = rows.shape[0]
        step, graph = self._step(self.bucket(B), tree_size)
        step.load(tokens, tree_mask, rows, seq_lens, active)
        graph.replay()
        return step.result(B)

    def forward(self, batch: ForwardBatch, tree_size: int) -> torch.Tensor:
        """The logits of ``batch`` (B requests of ``tree_size`` (n) rows each, tree mask given when
        n > 1): float32[B*n, V], a view valid until the next call with the same shape."""
        B = batch.req_pool_indices.shape[0]
        N = B * tree_size
        padded = self.bucket(B)
        entry = self._forward(padded, tree_size)
        s = entry.batch
        s.input_ids[:N].copy_(batch.input_ids)
        s.positions[:N].copy_(batch.positions)
        s.out_cache_loc[:N].copy_(batch.out_cache_loc)
        s.req_pool_indices[:B].copy_(batch.req_pool_indices)
        s.kv_lens[:B].copy_(batch.kv_lens)
        if tree_size > 1:
            s.tree_mask[:B].copy_(batch.tree_mask)
        if B < padded:
            s.out_cache_loc[N:].fill_(-1)
            s.kv_lens[B:].fill_(0)
        entry.graph.replay()
        return entry.logits[:N]

    @property
    def prefill_capacity(self) -> tuple[int, int]:
        """The most requests and prompt tokens one captured prefill takes."""
        return PREFILL_BATCH, max(prefill_lengths(self.req_to_token.shape[1]), default=0)

    @property
    def prefill_sizes(self) -> list[tuple[int, int]]:
        """The (batch bucket, padded length) pairs whose prefill has been captured so far."""
        return sorted(self._prefills)

    def prefill(self, input_ids: torch.Tensor, out_cache_loc: torch.Tensor, rows: torch.Tensor, lens: list[int],
                upload) -> torch.Tensor | None:
        """Replay the padded prefill of B requests (see :meth:`PaddedPrefill.load`): float32[B, V],
        the logits of each one's last token, a view valid until the next prefill of the same
        shape; None for more than :data:`PREFILL_BATCH` requests or when their length bucket is
        longer than the request table (run them eagerly then). A shape's graph (batch bucket,
        length bucket) is captured at its first use unless :meth:`capture_prefills` took it."""
        padded = prefill_bucket(input_ids.shape[0])
        if padded > self.req_to_token.shape[1] or rows.shape[0] > PREFILL_BATCH:
            return None
        step, graph, logits = self._prefill(self.bucket(rows.shape[0]), padded)
        step.load(input_ids, out_cache_loc, rows, lens, upload)
        graph.replay()
        return logits[:rows.shape[0]]

    def capture_prefills(self) -> None:
        """Capture now the prefill of every batch bucket up to :data:`PREFILL_BATCH` requests and
        every length bucket the request table holds, so that no admission pays a capture later."""
        for batch in self.buckets:
            if batch > PREFILL_BATCH:
                break
            for padded in prefill_lengths(self.req_to_token.shape[1]):
                self._prefill(batch, padded)

    def _prefill(self, batch: int, padded: int) -> tuple[PaddedPrefill, object, torch.Tensor]:
        key = (batch, padded)
        entry = self._prefills.get(key)
        if entry is None:
            step = PaddedPrefill(self.model, self.kv, self.req_to_token, batch, padded)
            graph, logits = self._capture(step.run)
            entry = self._prefills[key] = (step, graph, logits)
        return entry

    def _capture(self, fn):
        """A graph of ``fn`` and its result. An eager run first compiles the kernels and settles the
        allocations; capture runs on inputs that store no K/V, so neither changes the cache."""
        fn()
        self.runtime.synchronize()
        graph = self.runtime.new_graph()
        with self.runtime.capture(graph, pool=self.pool):
            out = fn()
        self.captures += 1
        return graph, out

    def _step(self, padded: int, tree_size: int) -> tuple[GreedyStep, object]:
        key = (padded, tree_size)
        found = self._steps.get(key)
        if found is None:
            step = GreedyStep(self.model, self.kv, self.req_to_token, padded, tree_size, self.drafter)
            graph, _ = self._capture(step.run)
            found = self._steps[key] = (step, graph)
        return found

    def _forward(self, padded: int, tree_size: int) -> _Forward:
        key = (padded, tree_size)
        entry = self._forwards.get(key)
        if entry is None:
            dev, N = self.model.device, padded * tree_size
            tree_mask = _identity_masks(padded, tree_size, dev) if tree_size > 1 else None
            batch = ForwardBatch(input_ids=_index(N, 0, dev), positions=_index(N, 0, dev),
                                 out_cache_loc=_index(N, -1, dev), req_to_token=self.req_to_token,
                                 req_pool_indices=_index(padded, 0, dev), kv_lens=_index(padded, 0, dev),
                                 q_lens=_index(padded, tree_size, dev), tree_mask=tree_mask,
                                 chains=self.drafter is not None, max_kv_len=self.req_to_token.shape[1],
                                 logits_index=None)
            graph, logits = self._capture(lambda: self.model.forward(batch, self.kv))
            entry = self._forwards[key] = _Forward(batch, graph, logits)
        return entry

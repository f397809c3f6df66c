"""Launching steps: a prefill, or a verify step of the running batch, captured or op by op.

:class:`StepRunner` enqueues a step's device work and the copies of its results to the host,
and returns the :class:`~ngram_hal.engine.overlap.InflightStep` to wait for; it never waits
itself. It holds the :class:`~ngram_hal.speculative.relay.OverlapRelay`, the device-side state one
step hands the next (last tokens, lengths).
"""

from __future__ import annotations

import time
from functools import partial
from itertools import accumulate

import torch

from ..kv_cache import KVCache
from ..speculative.relay import OverlapRelay
from ..speculative.sources import DraftSource, Trees
from .graphs import StepGraphs
from .model import ForwardBatch, LlamaModel
from .overlap import InflightStep, Transfer
from .request import Request
from .sampling import SamplingBatch, positional_uniforms, sample_from_probs, token_logprobs
from .scheduler import Scheduler
from .stats import EngineStats
from .verify_step import verify_step


class StepRunner:
    """Enqueues the steps of one engine.

    Args:
        model, kv: the target model and its KV cache.
        sched: the scheduler (its request table and tree size).
        transfer: host<->device copies.
        drafts: where the trees come from.
        graphs: the captured steps, or None.
        stats: the engine's counters (steps, tree nodes, launch and drafting time).
    """

    def __init__(self, model: LlamaModel, kv: KVCache, sched: Scheduler, transfer: Transfer, drafts: DraftSource,
                 graphs: StepGraphs | None, stats: EngineStats):
        self.model, self.kv, self.sched, self.transfer = model, kv, sched, transfer
        self.drafts, self.graphs, self.stats = drafts, graphs, stats
        self.backend = model.backend
        self.device = model.device
        self.relay = OverlapRelay.empty(1, self.device)
        # The request-table rows of the last verify step's batch, on the device: uploaded again
        # only when the batch changes (most steps run the same requests).
        self._rows: tuple[tuple[int, ...], torch.Tensor] | None = None

    def drop(self, keep: list[int]) -> None:
        """Keep only the relay's requests at indices ``keep`` (in order)."""
        self.relay = self.relay.filter(self.transfer.upload(keep))

    def prefill(self, reqs: list[Request]) -> InflightStep:
        """Enqueue the prompt forward of newly admitted requests and the sampling of their first tokens."""
        start = time.perf_counter()
        begin = self._begin()
        up, be = self.transfer.upload, self.backend
        lens = [len(r.prompt_ids) for r in reqs]
        B, N = len(reqs), sum(lens)
        rows, lens_dev = up([r.row for r in reqs]), up(lens)
        out_cache_loc = be.gather_cache_locs(self.sched.req_to_token, rows, torch.zeros_like(lens_dev), lens_dev,
                                             num_tokens=N)
        input_ids = up([t for r in reqs for t in r.prompt_ids])
        sampling = SamplingBatch([r.params for r in reqs], 1, up)
        want_logprobs = any(r.params.logprobs for r in reqs)
        logits = tokens = None
        if self.graphs is not None:
            logits = self.graphs.prefill(input_ids, out_cache_loc, rows, lens, up)
        if logits is None:
            batch = ForwardBatch(
                input_ids=input_ids, positions=up([p for n in lens for p in range(n)]),
                out_cache_loc=out_cache_loc, req_to_token=self.sched.req_to_token, req_pool_indices=rows,
                kv_lens=lens_dev, q_lens=lens_dev, tree_mask=None, max_kv_len=max(lens),
                logits_index=up([end - 1 for end in accumulate(lens)]))
            if sampling.all_greedy and not want_logprobs:
                tokens = self.model.forward_argmax(batch, self.kv)
            else:
                logits = self.model.forward(batch, self.kv)
        if tokens is None:
            # The first new token takes position len(prompt).
            tokens = (logits.argmax(-1) if sampling.all_greedy else
                      sample_from_probs(sampling.probs(logits), positional_uniforms(self._seed_rows(reqs, 1), lens_dev)))
        relay = OverlapRelay(tokens, torch.ones(B, dtype=torch.int64, device=self.device), lens_dev, 1)
        self.relay = self.relay.merge(relay)
        logprobs = token_logprobs(logits, tokens) if want_logprobs else None
        for r, n in zip(reqs, lens):
            r.seq_len = n
            r.inflight += 1
        self.stats.prefill_steps += 1
        step = self._ship("prefill", reqs, relay, logprobs, start, begin)
        # The prompts go to the drafter while the device runs the prefill.
        drafting = time.perf_counter()
        self.drafts.add_prompts([r.rid for r in reqs], [r.prompt_ids for r in reqs], rows, lens_dev, input_ids)
        self.stats.draft_s += time.perf_counter() - drafting
        return step

    def decode(self, reqs: list[Request], tree_size: int, bucket: int, context: float,
               score_plain: bool) -> InflightStep:
        """Enqueue a verify step of the running batch ``reqs`` (in relay order) with trees of tree
        size up to ``tree_size``, as the policy chose for ``bucket`` at ``context``; ``score_plain``:
        a plain step scores each request's first draft where the drafter has it for free."""
        start = time.perf_counter()
        tree_size = self.drafts.plan([r.rid for r in reqs], tree_size, padded=self.graphs is not None)
        self.stats.draft_s += time.perf_counter() - start
        # Device time starts here: host drafting above is time the device may spend idle.
        begin = self._begin()
        relay = self.relay
        rows = self._batch_rows(reqs)
        trees = self.drafts.trees(relay, rows, tree_size, score_plain)
        captured = (self.graphs is not None and all(r.params.greedy for r in reqs)
                    and not any(r.params.logprobs for r in reqs))
        logprobs = None
        if captured:
            result = self.graphs.greedy_step(trees.tokens, trees.mask, rows, relay.new_seq_lens, tree_size,
                                             trees.active)
        else:
            bound = max(r.seq_bound(self.sched.tree_size) for r in reqs)
            result, logprobs = self._verify(reqs, trees, rows, relay.new_seq_lens, bound + tree_size)
        self.drafts.stepped(rows, result, captured)
        self.relay = result
        for r in reqs:
            r.inflight += 1
        self.stats.decode_steps += 1
        self.stats.tree_nodes += tree_size
        shadow = None if trees.guess is None else trees.guess == result.accept_tokens
        step = self._ship("decode", reqs, result, logprobs, start, begin, shadow)
        step.tree_size, step.bucket, step.offered, step.context = tree_size, bucket, trees.offered, context
        return step

    def _batch_rows(self, reqs: list[Request]) -> torch.Tensor:
        """int64[B]: the request-table rows of ``reqs`` on the device (read only)."""
        key = tuple(r.row for r in reqs)
        if self._rows is None or self._rows[0] != key:
            self._rows = key, self.transfer.upload(key)
        return self._rows[1]

    def _verify(self, reqs: list[Request], trees: Trees, rows: torch.Tensor, seq_lens: torch.Tensor,
                max_kv_len: int) -> tuple[OverlapRelay, torch.Tensor | None]:
        """One verify step op by op (sampling, log-probabilities, or no graphs): the relay and the
        log-probabilities of the committed tokens (None unless a request asks for them)."""
        B, n = len(reqs), trees.tree_size
        forward = (partial(self.graphs.forward, tree_size=n) if self.graphs is not None
                   else partial(self.model.forward, kv=self.kv))
        sampling = SamplingBatch([r.params for r in reqs], n, self.transfer.upload)
        want_logprobs = any(r.params.logprobs for r in reqs)
        kept: list[torch.Tensor] = []  # the forward's logits, for the log-probabilities

        def from_logits(batch: ForwardBatch) -> torch.Tensor:
            logits = forward(batch)
            kept.append(logits)
            return logits.argmax(-1) if sampling.all_greedy else self._sample(sampling, reqs, n, logits, batch.positions)

        # (Greedy steps without log-probabilities reach here only where nothing is captured.)
        greedy_only = sampling.all_greedy and not want_logprobs
        target = partial(self.model.forward_argmax, kv=self.kv) if greedy_only else from_logits
        q_lens = torch.full((B,), n, dtype=torch.int64, device=self.device)
        result, out = verify_step(self.backend, target, self.kv, self.sched.req_to_token,
                                  trees.tokens.contiguous().view(-1), trees.mask, rows, seq_lens, q_lens, n, max_kv_len,
                                  chains=trees.chains, active=trees.active)
        logprobs = None
        if want_logprobs:
            node_lp = token_logprobs(kept[0], out.predicts)
            index = out.accept_index.view(-1)
            logprobs = torch.where(index >= 0, node_lp.gather(0, index.clamp(min=0)), 0.0)
        return result, logprobs

    def _sample(self, sampling: SamplingBatch, reqs: list[Request], n: int, logits: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        """The target's own token after each of the B*n nodes, drawn with the uniform of the
        position after the node's (see :mod:`ngram_hal.engine.sampling`)."""
        uniforms = positional_uniforms(self._seed_rows(reqs, n), positions + 1)
        return sample_from_probs(sampling.probs(logits), uniforms)

    def _seed_rows(self, reqs: list[Request], rows: int) -> torch.Tensor:
        """Each request's seed bits repeated for its ``rows`` rows, on the device (0 for greedy ones)."""
        seeds = torch.tensor([r.seed or 0 for r in reqs], dtype=torch.int64).repeat_interleave(rows)
        return self.transfer.upload(seeds)

    def _begin(self):
        """A timing event recorded before a step's first device op."""
        runtime = self.backend.runtime
        event = runtime.new_event(enable_timing=True)
        event.record(runtime.current_stream())
        return event

    def _ship(self, kind: str, reqs: list[Request], relay: OverlapRelay, logprobs: torch.Tensor | None,
              start: float, begin, shadow: torch.Tensor | None = None) -> InflightStep:
        """Copy a step's results to the host and record the event that says they are there."""
        down = self.transfer.download
        runtime = self.backend.runtime
        step = InflightStep(kind, reqs, relay.tree_size, down(relay.accept_tokens), down(relay.accept_lens),
                            None if logprobs is None else down(logprobs), runtime.new_event(enable_timing=True),
                            begin=begin, shadow=None if shadow is None else down(shadow))
        step.event.record(runtime.current_stream())
        step.launch_s = time.perf_counter() - start
        self.stats.launch_s += step.launch_s
        return step

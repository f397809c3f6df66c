"""The engine: continuous batching, n-gram speculative decoding and the overlap loop.

A step is a prefill (newly admitted requests: prompt forward, first token sampled) or a verify
step (every running request: a draft tree of D nodes whose root is the request's last committed
token, one target forward over all B*D nodes, greedy or sampled tree verify, KV compaction).
With D == 1 the tree is the root alone and a verify step is a plain decode step.

What the overlap loop overlaps. Each launched step copies its results (committed tokens, their
counts, logprobs) into host buffers and records an event; the device-side state the next step
needs (last tokens, lengths) stays on the device in an :class:`OverlapRelay`. The host blocks
only in that event's ``synchronize()``. One call of :meth:`Engine.step`:

* without speculation (D == 1): schedules step t+1 (admission, slot allocation, inputs built
  from the relay) and enqueues it while the device is still on step t, *then* waits for step t
  and processes it (token commit, stop tokens and strings, detokenization, streaming outputs,
  freeing finished requests) while the device computes step t+1. No host work is on the
  device's critical path.
* with speculation (D > 1): the draft of step t+1 needs step t's accepted tokens, so the host
  first waits for step t and does the token-level part (commit, stop tokens, ``max_new_tokens``,
  drafter update); then it drafts, schedules, allocates and enqueues step t+1; only then does it
  do the text-level part of step t (detokenization, stop strings, outputs, freeing) while the
  device computes step t+1. Between steps the device waits for the results copy, the token-level
  commit, the drafting and the launch of step t+1. The relay still carries the roots and lengths
  on the device; only the D-1 draft tokens per request and the tree masks are uploaded. A step
  that the ``auto`` policy runs with one node drafts nothing, so it is launched as without
  speculation, before the host waits for step t.
* with speculation drafted on the device (``drafter="device"``,
  :class:`~ngram_hal.speculative.lookup.DeviceDrafter`): step t ends by recording its committed
  tokens in the drafter's token table and drafting chains of D for step t+1 (inside step t's
  graph where steps are captured), so step t+1 is enqueued before the host waits for step t, as
  without speculation, and takes the first n nodes of those chains with no launch of its own.
  Where the batch changed in between (a prefill joined, a request left), step t+1 records and
  drafts in a launch of its own first.

A request that turns out to have finished at step t may already be in step t+1; its results
there are dropped. On the CPU the device runs eagerly inside the launch, so the loop has the same
structure but nothing actually runs concurrently.
"""

from __future__ import annotations

import contextlib
import time
from functools import partial
from collections.abc import Iterator, Sequence
from itertools import accumulate
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..speculative.lookup import DeviceDrafter
from ..speculative.relay import OverlapRelay
from .detokenizer import IncrementalDetokenizer, TokenDecoder
from .graphs import StepGraphs, batch_buckets
from .intake import check_request, params_per_prompt
from .model import ForwardBatch, LlamaModel
from .overlap import InflightStep, Transfer
from .policy import Acceptance, SpecPolicy, tree_sizes
from .request import Request, RequestOutput, SamplingParams, Status
from .sampling import SamplingBatch, positional_uniforms, sample_from_probs, seed_bits, token_logprobs
from .scheduler import Scheduler
from .stats import EngineStats
from .verify_step import verify_step
from .stopping import check_stop_strings, commit_tokens


class EngineConfig(BaseModel):
    """Engine settings.

    ``spec_nodes`` is D, the draft-tree size per verify step; 1 turns speculation off.
    ``spec_policy="auto"`` lets each verify step use 1, 2, 4, ... or D nodes, whichever a cost
    model expects to commit the most tokens per second for the whole batch
    (:mod:`ngram_hal.engine.policy`); ``"always"`` uses D. With a host drafter
    (``"trie"``, ``"linear"``) a speculative step runs only as many tree nodes as the fullest draft
    of the batch holds: a plain decode step (1 node) when the drafter found nothing for any
    request. ``"device"`` drafts the linear drafter's chains on the device
    (:class:`~ngram_hal.speculative.lookup.DeviceDrafter`): the host never sees a draft, so every
    step runs the nodes the policy chose, and speculative steps overlap like plain ones.
    ``num_slots`` sizes the KV cache, handed out in pages of ``page_size`` slots (the last
    ``num_slots % page_size`` unused); ``max_running`` bounds the batch; ``max_context_len`` is
    the positions one request may use (prompt, output and ``3*D`` of speculation room), so D is
    at most :meth:`max_spec_nodes` of it.
    ``graphs`` replays decode and verify steps, and prefills of one request, from captured graphs
    where the backend's runtime can capture (:mod:`ngram_hal.engine.graphs`; never on the CPU or
    with a strict backend).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    spec_nodes: int = Field(8, ge=1)
    drafter: Literal["trie", "linear", "device"] = "trie"
    spec_policy: Literal["always", "auto"] = "always"
    probe_every: int = Field(16, ge=1)
    overlap: bool = True
    graphs: bool = True
    num_slots: int = Field(16384, ge=1)
    page_size: int = Field(1, ge=1)
    max_running: int = Field(32, ge=1)
    max_context_len: int = Field(2048, ge=8)
    max_prefill_tokens: int = Field(4096, ge=1)
    seed: int = 0

    @staticmethod
    def max_spec_nodes(max_context_len: int) -> int:
        """The largest D a context of ``max_context_len`` positions holds with room for one prompt
        token and one new token beside the ``3*D`` positions of speculation room."""
        return (max_context_len - 2) // 3

    @model_validator(mode="after")
    def _check_sizes(self) -> "EngineConfig":
        if self.page_size > self.num_slots:
            raise ValueError(f"page_size {self.page_size} exceeds num_slots {self.num_slots}: the cache holds no page")
        limit = self.max_spec_nodes(self.max_context_len)
        if self.spec_nodes > limit:
            raise ValueError(f"spec_nodes {self.spec_nodes} leaves no room in max_context_len {self.max_context_len} "
                             f"(a request keeps 3 * spec_nodes positions for draft trees): at most {limit}")
        return self


def make_drafter(kind: str):
    """The drafter named ``kind`` (``"trie"`` or ``"linear"``) with its default settings."""
    from ..speculative.drafter import LinearDrafter, TrieDrafter

    return {"trie": TrieDrafter, "linear": LinearDrafter}[kind]()


class Engine:
    """Generates for many requests at once over one model and one KV cache.

    Args:
        model: the target model; its backend runs every device op.
        tokenizer: needed for text prompts, stop strings and output text; optional otherwise.
        config: :class:`EngineConfig`.
        drafter: a :class:`ngram_hal.speculative.drafter.Drafter` (drafting on the host); default
            from ``config.drafter``.
        eos_token_ids: tokens that end a request (unless ``ignore_eos``); default the model's EOS.
    """

    def __init__(self, model: LlamaModel, tokenizer: TokenDecoder | None = None,
                 config: EngineConfig | None = None, drafter=None,
                 eos_token_ids: Sequence[int] | None = None):
        self.config = config or EngineConfig()
        self.model = model
        self.backend = model.backend
        supported = self.backend.page_sizes
        if supported is not None and self.config.page_size not in supported:
            raise ValueError(f"page_size {self.config.page_size}: the '{self.backend.name}' backend's alloc_extend "
                             f"takes pages of {', '.join(map(str, supported))}")
        self.tokenizer = tokenizer
        self.num_nodes = self.config.spec_nodes
        self.transfer = Transfer(self.backend.runtime)
        self.device = self.backend.device
        self.kv = model.new_kv_cache(self.config.num_slots)
        self.sched = Scheduler(self.backend, self.transfer, self.config.num_slots, self.config.max_running,
                               self.config.max_context_len, self.num_nodes, self.config.max_prefill_tokens,
                               self.config.page_size)
        self.lookup = None
        if drafter is None and self.num_nodes > 1 and self.config.drafter == "device":
            self.lookup = DeviceDrafter(self.backend, *self.sched.req_to_token.shape, num_nodes=self.num_nodes)
        self.drafter = drafter if drafter is not None else (
            make_drafter(self.config.drafter) if self.num_nodes > 1 and self.lookup is None else None)
        if self.drafter is not None:
            self.drafter.prepare()  # memory the drafter maps lazily is mapped now, not at the first requests
        if eos_token_ids is None:
            eos = model.config.eos_token_id
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = frozenset(eos_token_ids)
        self.graphs = None
        if self.config.graphs and self.backend.runtime.graph_capture and not self.backend.strict:
            self.graphs = StepGraphs(model, self.kv, self.sched.req_to_token, self.config.max_running, self.lookup)
            # A step with graphs runs 1, 2, 4, ... or D nodes: the sizes the policy picks among.
            self.graphs.capture_all(tree_sizes(self.num_nodes))
        self.policy = SpecPolicy(self.num_nodes, self.config.spec_policy, self.config.probe_every)
        self._buckets = self.graphs.buckets if self.graphs is not None else batch_buckets(self.config.max_running)
        if self.graphs is not None and self.policy.mode == "auto":
            self.graphs.calibrate(self.policy.costs, self.policy.sizes)
        self._acceptance: dict[str, Acceptance] = {}
        self.relay = OverlapRelay.empty(1, self.device)
        # The relay whose requests the device drafter's next chains were drafted for (in its order).
        self._chains_for: OverlapRelay | None = None
        self._last_kind: str | None = None
        self._last_end = None
        # The host's work in the last turn of the overlapped loop (its time not waiting for the device).
        self._host_s = 0.0
        self.inflight: InflightStep | None = None
        self._requests: dict[str, Request] = {}
        self._pending: list[RequestOutput] = []
        self._restart_counts()

    # ------------------------------------------------------------------ one-time work

    def warm_up(self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None,
                max_batch: int | None = None) -> float:
        """Do now the one-time work that serving ``prompts`` would otherwise do on its first pass,
        and return the seconds it took: the prompts run (in batches of ``max_batch``, default the
        engine's ``max_running``) for a few tokens each, which compiles the kernels of their shapes
        and captures their prefill graphs (on a host runtime the first prompt alone, which compiles
        the CPU kernels); where steps are captured and ``params`` samples or
        wants log-probabilities, the forward graphs of every batch bucket and tree size are
        captured too. Then :meth:`forget_drafts`, so that what the prompts taught the drafter does
        not help the real run, and the statistics and the seeds of unseeded requests start again.
        Greedy decode and verify steps were captured when the engine was made. Nothing may be in
        the engine."""
        if self.has_unfinished():
            raise ValueError("warm_up: the engine still has requests; warm it up before queuing any")
        start = time.perf_counter()
        params = params or SamplingParams()
        short = params.model_copy(update={"max_new_tokens": min(params.max_new_tokens, 4), "stop": ()})
        size = max_batch or self.config.max_running
        if self.backend.runtime.is_host:
            prompts = prompts[:1]  # no graphs, and kernels that do not compile per shape: one prompt does
        for i in range(0, len(prompts), size):
            self.generate(list(prompts[i:i + size]), short)
        if self.graphs is not None and (not params.greedy or params.logprobs):
            self.graphs.capture_forwards(tree_sizes(self.num_nodes))
        self.backend.runtime.synchronize()
        self.forget_drafts()
        self._restart_counts()
        return time.perf_counter() - start

    def _restart_counts(self) -> None:
        """Statistics from zero, and the seeds of unseeded requests drawn from ``config.seed`` again."""
        self.stats = EngineStats()
        self._seeds = torch.Generator().manual_seed(self.config.seed)

    def forget_drafts(self) -> None:
        """A new drafter and speculation policy, as a new engine would have, keeping the captured
        graphs and the step costs the policy measured (they are the device's, not the text's): the
        shared n-gram corpus keeps every output it saw, which must not help later requests that a
        fresh engine would serve without it. A drafter on the device stays: it learns only from its
        own request's tokens, which each prefill writes anew."""
        if self.drafter is not None:
            self.drafter = make_drafter(self.config.drafter)
            self.drafter.prepare()
        self.policy = SpecPolicy(self.num_nodes, self.config.spec_policy, self.config.probe_every,
                                 costs=self.policy.costs)

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt: str | Sequence[int], params: SamplingParams | None = None,
                    rid: str | None = None) -> str:
        """Queue a request; returns its id.

        ``prompt`` is text (needs a tokenizer) or a sequence of token ids; ``params`` a
        :class:`SamplingParams` or None (the defaults); ``rid`` a string or None (one is made).
        Bad arguments, of any type, raise ``ValueError`` and change nothing. A request that can
        never run (its prompt leaves no room in the context, or it needs more slots than the
        cache has) is accepted and finishes at once with ``finish_reason == "error"`` and a
        message; other requests are unaffected.
        """
        req = self._check(prompt, params, rid)
        self._admit(req)
        return req.rid

    def _check(self, prompt, params, rid, label: str = "") -> Request:
        """A validated :class:`Request` (:func:`~ngram_hal.engine.intake.check_request`)."""
        return check_request(prompt, params, rid, vocab_size=self.model.config.vocab_size, tokenizer=self.tokenizer,
                             live=self._requests, label=label)

    def _admit(self, req: Request) -> None:
        """Queue a validated request, or finish it at once with the reason it can never run."""
        params = req.params
        req.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.eos_token_ids)
        if self.tokenizer is not None:
            req.detok = IncrementalDetokenizer(self.tokenizer)
        if not params.greedy:
            seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._seeds))
            req.seed = seed_bits(seed)
        error = self.sched.check(req)
        self._requests[req.rid] = req
        if error is not None:
            req.finish("error", error)
            self._report(req)
        else:
            self.sched.waiting.append(req)

    def abort(self, rid: str) -> bool:
        """End a waiting or running request now, freeing its slots; False if it is unknown or done.

        If one of its steps is in flight, that step's results for it are dropped.
        """
        req = self._requests.get(rid)
        if req is None or req.finished:
            return False
        if req.status is Status.WAITING:
            self.sched.waiting.remove(req)
        req.finish("abort")
        self._release([req])
        self._report(req)
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running, in flight or has an output not yet returned."""
        return bool(self.sched.waiting or self.sched.running or self.inflight is not None or self._pending)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run ``prompts`` to completion; the final output of each, in order.

        The requests are queued by :meth:`add_requests`: all of them, or none.
        """
        rids = self.add_requests(prompts, params)
        final = {out.rid: out for out in self.follow(rids) if out.finished}
        return [final[rid] for rid in rids]

    def stream(self, prompts: Sequence[str | Sequence[int]],
               params: SamplingParams | Sequence[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Queue ``prompts`` by :meth:`add_requests` and yield their incremental outputs as steps
        produce them.

        Each output carries the tokens and text added since the previous one of its request; the
        last one of a request has ``finished`` set.
        """
        return self.follow(self.add_requests(prompts, params))

    def add_requests(self, prompts: Sequence[str | Sequence[int]],
                     params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[str]:
        """Queue several requests at once; returns their ids, in order.

        ``params`` is one :class:`SamplingParams` for every prompt, one per prompt, or None.
        Every request is validated before any is queued: a bad one raises ``ValueError`` naming
        its index (``prompts[i]: ...``), and the engine is left as it was.
        """
        per = params_per_prompt(prompts, params)
        reqs = [self._check(p, sp, None, label=f"prompts[{i}]: ") for i, (p, sp) in enumerate(zip(prompts, per))]
        for req in reqs:
            self._admit(req)
        return [req.rid for req in reqs]

    def follow(self, rids: Sequence[str]) -> Iterator[RequestOutput]:
        """Step the engine until the requests ``rids`` have finished, yielding their outputs.

        Other requests in the engine advance too; their outputs are not yielded.
        """
        mine, live = set(rids), set(rids)
        while live:
            if not self.has_unfinished():
                raise KeyError(f"rids: not in the engine: {sorted(live)}")
            for out in self.step():
                if out.rid in mine:
                    if out.finished:
                        live.discard(out.rid)
                    yield out

    # ------------------------------------------------------------------ the loop

    def step(self) -> list[RequestOutput]:
        """Run one turn of the loop (see the module docstring); outputs of requests that advanced."""
        outputs, self._pending = self._pending, []
        if not self.config.overlap:
            step = self._launch()
            if step is not None:
                self._absorb(step, critical=True)
                outputs += self._process(step, hidden=False)
            return outputs
        start = time.perf_counter()
        prev, self.inflight = self.inflight, None
        if prev is not None and self._drafts_next():
            self._absorb(prev, critical=True)
        self.inflight = self._launch()
        if prev is not None:
            if not prev.absorbed:
                self._absorb(prev, critical=False)
            outputs += self._process(prev, hidden=self.inflight is not None)
            self._host_s = time.perf_counter() - start - prev.wait_s
        return outputs

    def _drafts_next(self) -> bool:
        """Whether the next step may need the previous one's tokens on the host: a speculative
        step drafts from them, and admission waits for the requests they finish. A step the
        policy runs with one node (a plain decode step) does not, so it overlaps like one."""
        if self.num_nodes == 1:
            return False
        if self.sched.waiting or not self.sched.running:
            return True
        if self.lookup is not None:
            return False
        if self._drafter_busy():
            return False
        running = self.sched.running
        return self.policy.peek(self._bucket(len(running)), self._acceptances(running), self._context(running)) > 1

    def _drafter_busy(self) -> bool:
        """In ``auto``: the drafter still records in the background (a batch of prompts); steps
        run plain until it is done rather than wait for it (``always`` waits)."""
        return self.drafter is not None and self.policy.mode == "auto" and self.drafter.busy

    def _launch(self) -> InflightStep | None:
        admitted = self.sched.admit()
        if admitted:
            return self._launch_prefill(admitted)
        if self.sched.running:
            return self._launch_decode(list(self.sched.running))
        # Nothing to run: the wait until the next request is not the device idling between steps.
        self._last_end = None
        return None

    def _begin(self):
        """A timing event recorded before a step's first device op."""
        runtime = self.backend.runtime
        event = runtime.new_event(enable_timing=True)
        event.record(runtime.current_stream())
        return event

    def _launch_prefill(self, reqs: list[Request]) -> InflightStep:
        start = time.perf_counter()
        begin = self._begin()
        up, be = self.transfer.upload, self.backend
        lens = [len(r.prompt_ids) for r in reqs]
        B, N = len(reqs), sum(lens)
        rows, lens_dev = up([r.row for r in reqs]), up(lens)
        out_cache_loc = be.gather_cache_locs(self.sched.req_to_token, rows, torch.zeros_like(lens_dev), lens_dev,
                                             num_tokens=N)
        input_ids = up([t for r in reqs for t in r.prompt_ids])
        logits = None
        if self.graphs is not None and B == 1:
            logits = self.graphs.prefill(input_ids, out_cache_loc, rows)
        if logits is None:
            batch = ForwardBatch(
                input_ids=input_ids, positions=up([p for n in lens for p in range(n)]),
                out_cache_loc=out_cache_loc, req_to_token=self.sched.req_to_token, req_pool_indices=rows,
                kv_lens=lens_dev, q_lens=lens_dev, tree_mask=None, max_kv_len=max(lens),
                logits_index=up([end - 1 for end in accumulate(lens)]))
            logits = self.model.forward(batch, self.kv)
        sampling = SamplingBatch([r.params for r in reqs], 1, up)
        if sampling.all_greedy:
            tokens = logits.argmax(-1)
        else:
            # The first new token takes position len(prompt).
            tokens = sample_from_probs(sampling.probs(logits), positional_uniforms(self._seed_rows(reqs, 1), lens_dev))
        relay = OverlapRelay(tokens, torch.ones(B, dtype=torch.int64, device=self.device), lens_dev, 1)
        self.relay = self.relay.merge(relay)
        logprobs = None
        if any(r.params.logprobs for r in reqs):
            logprobs = token_logprobs(logits, tokens)
        for r, n in zip(reqs, lens):
            r.seq_len = n
            r.inflight += 1
        self.stats.prefill_steps += 1
        if self.lookup is not None:
            self.lookup.add_prompts(rows, lens_dev, input_ids)
        step = self._ship("prefill", reqs, relay, logprobs, start, begin)
        if self.drafter is not None:
            # The prompts go into the drafter while the device runs the prefill (a large batch of
            # them in the background: see _drafter_busy).
            with self._drafting():
                for r in reqs:
                    self.drafter.add_request(r.rid, r.prompt_ids)
                self.drafter.prepare()
        return step

    def _launch_decode(self, reqs: list[Request]) -> InflightStep:
        start = time.perf_counter()
        up, D = self.transfer.upload, self.num_nodes
        B = len(reqs)
        bucket = self._bucket(B)
        acceptances = self._acceptances(reqs)
        context = self._context(reqs)
        n = 1 if self._drafter_busy() else self.policy.choose(bucket, acceptances, context)
        offered = [n - 1] * B
        if n > 1 and self.drafter is not None:
            size = n
            draft = self.drafter.draft([r.rid for r in reqs], n)
            self.stats.draft_s += time.perf_counter() - start
            # Nodes past every tree's drafted count are padding: run the step on the first n of
            # them (BFS order keeps each parent before its children), 1 when nothing was drafted.
            n = int(draft.drafted.max())
            if self.graphs is not None and n > 1:
                # Captured shapes: round up to a power of two (more padding nodes, fewer graphs).
                n = min(size, 1 << (n - 1).bit_length())
            offered = [min(n, d) - 1 for d in draft.drafted.tolist()]
        # Device time starts here: the drafting above is host time the device may spend idle.
        begin = self._begin()
        bounds = [r.seq_bound(D) for r in reqs]
        self.sched.reserve(reqs, bounds)
        relay = self.relay
        seq_lens = relay.new_seq_lens
        rows = up([r.row for r in reqs])
        guess = None
        if self.lookup is not None:
            # The chains the previous step drafted for this very batch, or a launch that drafts them.
            # A plain step under auto keeps each chain's first draft, to score it against the token
            # the step commits (the device drafts it anyway): acceptance keeps following the text.
            width = 2 if n == 1 and self.policy.mode == "auto" else n
            chains = (self.lookup.chains_ahead(B, width) if self._chains_for is relay
                      else self.lookup.draft(rows, relay, width).view(B, width))
            tokens = chains[:, :n]
            if width > n:
                guess = chains[:, 1].clone()
                offered = [1] * B
            tree_mask = None
        elif n > 1:
            drafts = up(draft.tokens.view(B, -1)[:, 1:n].contiguous())
            tokens = torch.cat([relay.last_tokens().unsqueeze(1), drafts], dim=1).view(-1)
            tree_mask = up(draft.tree_mask[:, :n, :n].contiguous())
        else:
            tokens = relay.last_tokens().contiguous()
            tree_mask = torch.ones((B, 1, 1), dtype=torch.bool, device=self.device)
        greedy = all(r.params.greedy for r in reqs)
        want_logprobs = any(r.params.logprobs for r in reqs)
        logprobs = None
        if self.graphs is not None and greedy and not want_logprobs:
            # With the device drafter, the captured step drafts the next step's chains too.
            result = self.graphs.greedy_step(tokens, tree_mask if n > 1 else None, rows, seq_lens, n)
        else:
            if self.lookup is not None:
                tokens, tree_mask = tokens.contiguous().view(-1), self.lookup.chain_masks(B, n)
            result, logprobs = self._verify_step(reqs, tokens, tree_mask, rows, seq_lens, n, max(bounds) + n)
            if self.lookup is not None:
                self.lookup.draft_next(rows, result)
        self.relay = result
        if self.lookup is not None:
            self._chains_for = result
        for r in reqs:
            r.inflight += 1
        self.stats.decode_steps += 1
        self.stats.tree_nodes += n
        shadow = None if guess is None else guess == result.accept_tokens
        step = self._ship("decode", reqs, result, logprobs, start, begin, shadow)
        step.tree_size, step.bucket, step.offered, step.context = n, bucket, offered, context
        return step

    def _bucket(self, batch_size: int) -> int:
        """The batch bucket whose step costs a batch of ``batch_size`` requests shares."""
        return next(b for b in self._buckets if b >= batch_size)

    def _context(self, reqs: list[Request]) -> float:
        """The mean keys per request before a step's trees (as the host knows the lengths: the
        step in flight not counted); 0 where the policy does not read it (``always``)."""
        return sum(r.seq_len for r in reqs) / len(reqs) if self.policy.mode == "auto" else 0.0

    def _acceptances(self, reqs: list[Request]) -> list[Acceptance]:
        """Each request's record of accepted drafts (a new one for a request's first verify step);
        none where the policy does not read them (``always``), and then none are kept."""
        if self.policy.mode != "auto":
            return []
        records = self._acceptance
        for r in reqs:
            if r.rid not in records:
                records[r.rid] = Acceptance()
        return [records[r.rid] for r in reqs]

    def _verify_step(self, reqs: list[Request], tokens: torch.Tensor, tree_mask: torch.Tensor, rows: torch.Tensor,
                     seq_lens: torch.Tensor, n: int, max_kv_len: int) -> tuple[OverlapRelay, torch.Tensor | None]:
        """One verify step op by op (sampling, log-probabilities, or no graphs): the relay and the
        log-probabilities of the committed tokens (None unless a request asks for them)."""
        B = len(reqs)
        forward = (partial(self.graphs.forward, nodes=n) if self.graphs is not None
                   else partial(self.model.forward, kv=self.kv))
        sampling = SamplingBatch([r.params for r in reqs], n, self.transfer.upload)
        sample = None if sampling.all_greedy else partial(self._sample, sampling, reqs, n)
        q_lens = torch.full((B,), n, dtype=torch.int64, device=self.device)
        result, logits, out = verify_step(self.backend, forward, self.kv, self.sched.req_to_token, tokens, tree_mask,
                                          rows, seq_lens, q_lens, n, max_kv_len, sample=sample)
        logprobs = None
        if any(r.params.logprobs for r in reqs):
            node_lp = token_logprobs(logits, out.predicts)
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

    def _ship(self, kind: str, reqs: list[Request], relay: OverlapRelay, logprobs: torch.Tensor | None,
              start: float, begin, shadow: torch.Tensor | None = None) -> InflightStep:
        down = self.transfer.download
        runtime = self.backend.runtime
        step = InflightStep(kind, reqs, relay.num_nodes, down(relay.accept_tokens), down(relay.accept_lens),
                            None if logprobs is None else down(logprobs), runtime.new_event(enable_timing=True),
                            begin=begin, shadow=None if shadow is None else down(shadow))
        step.event.record(runtime.current_stream())
        step.launch_s = time.perf_counter() - start
        self.stats.launch_s += step.launch_s
        return step

    def _absorb(self, step: InflightStep, critical: bool) -> None:
        """Token level: wait for ``step``, commit its tokens, apply stop tokens and length, feed the drafter."""
        step.wait()
        start = time.perf_counter()
        D = step.num_nodes
        tokens, lens = step.tokens.tolist(), step.lens.tolist()
        shadow = step.shadow.tolist() if step.shadow is not None else None
        logprobs = step.logprobs.tolist() if step.logprobs is not None else None
        ended, fed, rows, committed = [], [], 0, 0
        for b, r in enumerate(step.reqs):
            r.inflight -= 1
            if r.finished:
                continue
            n = lens[b]
            run = tokens[b * D:b * D + n]
            if step.kind == "decode":
                r.seq_len += n
                r.verify_steps += 1
                rows += 1
                committed += n
                record = self._acceptance.get(r.rid)
                if record is not None:
                    record.add(step.offered[b], int(shadow[b]) if shadow is not None else n - 1)
            commit_tokens(r, run, logprobs[b * D:b * D + n] if r.params.logprobs else None)
            if r.finished:
                ended.append(r)
            elif self.drafter is not None:
                fed.append((r.rid, run))
        if self.drafter is not None:
            with self._drafting():
                for rid, run in fed:
                    self.drafter.extend(rid, run)
                if not critical:
                    # The device is busy with the next step: record the new tokens now, not in the next draft.
                    self.drafter.prepare()
        self._release(ended)
        step.absorbed = True
        self._observe(step, rows, committed, self._time_device(step))
        self.stats.wait_s += step.wait_s
        elapsed = time.perf_counter() - start
        if critical:
            self.stats.critical_s += elapsed
        else:
            self.stats.process_s += elapsed

    @contextlib.contextmanager
    def _drafting(self):
        """Count the host time of the block as time in the drafter (``stats.draft_s``)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stats.draft_s += time.perf_counter() - start

    def _time_device(self, step: InflightStep) -> float | None:
        """Add the step's device time, and the device's idle time since the previous step ended;
        returns the device seconds from the previous step's end to this one's (None where the
        runtime does not time, or no step ran just before)."""
        if self.backend.runtime.is_host:
            return None
        self.stats.device_busy_s += step.begin.elapsed_time(step.event) / 1e3
        interval = None
        if self._last_end is not None:
            self.stats.device_idle_s += max(0.0, self._last_end.elapsed_time(step.begin) / 1e3)
            interval = self._last_end.elapsed_time(step.event) / 1e3
        self._last_end = step.event
        return interval

    def _observe(self, step: InflightStep, rows: int, committed: int, interval: float | None) -> None:
        """Feed a finished step to the statistics and the speculation policy. A step's time is the
        device's ``interval`` since the previous step ended where the runtime times it (None
        after a prefill); on a host runtime, where a step computes inside its launch, the launch's
        host time (drafting included). The policy also gets the host's work in the last turn of
        the overlapped loop, the floor under any step's time where the host sets the pace."""
        if step.kind == "decode":
            self.stats.decode_tokens += committed
            self.stats.decode_rows += rows
            seconds = step.launch_s if self.backend.runtime.is_host else interval
            if rows and self._last_kind == "decode":
                self.policy.observe(step.bucket, step.tree_size, seconds, step.context, self._host_s)
        self._last_kind = step.kind

    def _process(self, step: InflightStep, hidden: bool) -> list[RequestOutput]:
        """Text level: stop strings and detokenization, outputs, freeing finished requests."""
        start = time.perf_counter()
        outputs, ended = [], []
        for r in step.reqs:
            if r.reported:
                continue
            check_stop_strings(r)
            if r.finished:
                ended.append(r)
                outputs.append(self._report(r, pending=False))
            elif r.emitted_tokens < len(r.output_ids):
                outputs.append(r.take_output())
        self._release(ended)
        elapsed = time.perf_counter() - start
        if hidden:
            self.stats.process_s += elapsed
        else:
            self.stats.critical_s += elapsed
        return outputs

    def _release(self, reqs: list[Request]) -> None:
        """Drop finished requests from the batch and the relay, and free their rows and slots."""
        held = [r for r in reqs if r.row >= 0]
        if not held:
            return
        gone = set(map(id, held))
        running = self.sched.running
        keep = [i for i, r in enumerate(running) if id(r) not in gone]
        if len(keep) < len(running):
            self.relay = self.relay.filter(self.transfer.upload(keep))
        if self.drafter is not None:
            for r in held:
                self.drafter.erase(r.rid)
        for r in held:
            self._acceptance.pop(r.rid, None)
        self.sched.release(held)

    def _report(self, req: Request, pending: bool = True) -> RequestOutput:
        out = req.take_output()
        req.reported = True
        self._requests.pop(req.rid, None)
        if pending:
            self._pending.append(out)
        return out

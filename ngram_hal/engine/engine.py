"""The engine: continuous batching and n-gram speculative decoding over one model and one KV cache.

A step is a prefill (newly admitted requests: prompt forward, first token sampled) or a verify
step (every running request: a draft tree of tree size D whose root is the request's last
committed token, one target forward over all B*D nodes, greedy or sampled tree verify, KV
compaction). With D == 1 the tree is the root alone and a verify step is a plain decode step.

:class:`Engine` is the callers' side: requests in (checked by :mod:`ngram_hal.engine.intake`),
outputs out, and the one-time work before serving. Each :meth:`Engine.step` is one turn of the
overlap loop (:mod:`ngram_hal.engine.loop`), which launches the steps and processes their results.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial

import torch

from ..speculative.drafter import Drafter, make_drafter
from ..speculative.lookup import DeviceDrafter
from ..speculative.sources import DeviceDrafts, DraftSource, HostDrafts
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, TokenDecoder
from .graphs import StepGraphs, batch_buckets
from .intake import check_request, params_per_prompt
from .loop import OverlapLoop
from .model import LlamaModel
from .overlap import Transfer
from .policy import SpecPolicy, tree_sizes
from .postprocess import Postprocessor
from .request import Request, RequestOutput, SamplingParams, Status
from .runner import StepRunner
from .sampling import seed_bits
from .scheduler import Scheduler
from .stats import EngineStats

__all__ = ["Engine", "EngineConfig"]


class Engine:
    """Generates for many requests at once over one model and one KV cache.

    Args:
        model: the target model; its backend runs every device op.
        tokenizer: needed for text prompts, stop strings and output text; optional otherwise.
        config: :class:`EngineConfig`.
        drafter: makes the host :class:`~ngram_hal.speculative.drafter.Drafter` to draft with (a
            class, or any callable of no arguments; :meth:`forget_drafts` calls it again);
            default from ``config.drafter``.
        eos_token_ids: tokens that end a request (unless ``ignore_eos``); default the model's EOS.

    Its parts, each a module of its own: the :class:`~ngram_hal.engine.scheduler.Scheduler`
    (admission, slots), the draft source (:mod:`ngram_hal.speculative.sources`), the
    :class:`~ngram_hal.engine.policy.SpecPolicy`, the :class:`~ngram_hal.engine.runner.StepRunner`
    (launching steps), the :class:`~ngram_hal.engine.postprocess.Postprocessor` (their results)
    and the :class:`~ngram_hal.engine.loop.OverlapLoop` (when each step runs).
    """

    def __init__(self, model: LlamaModel, tokenizer: TokenDecoder | None = None,
                 config: EngineConfig | None = None, drafter: Callable[[], Drafter] | None = None,
                 eos_token_ids: Sequence[int] | None = None):
        self.config = cfg = config or EngineConfig()
        self.model, self.backend, self.tokenizer = model, model.backend, tokenizer
        supported = self.backend.page_sizes
        if supported is not None and cfg.page_size not in supported:
            raise ValueError(f"page_size {cfg.page_size}: the '{self.backend.name}' backend's alloc_extend "
                             f"takes pages of {', '.join(map(str, supported))}")
        if model.tensor_parallel is not None and cfg.spec_policy == "auto":
            raise ValueError("spec_policy 'auto' under tensor parallelism: each rank would choose tree sizes from its "
                             "own timings and the ranks would part; use 'always'")
        self.tree_size = cfg.tree_size
        transfer = Transfer(self.backend.runtime)
        self.kv = model.new_kv_cache(cfg.num_slots)
        self.sched = Scheduler(self.backend, transfer, cfg.num_slots, cfg.max_running, cfg.max_context_len,
                               self.tree_size, cfg.max_prefill_tokens, cfg.page_size)
        if self.tree_size == 1:
            self.drafts = DraftSource()
        elif drafter is None and cfg.drafter == "device":
            self.drafts = DeviceDrafts(DeviceDrafter(self.backend, *self.sched.req_to_token.shape,
                                                     tree_size=self.tree_size))
        else:
            self.drafts = HostDrafts(drafter or partial(make_drafter, cfg.drafter), transfer.upload)
        if eos_token_ids is None:
            eos = model.config.eos_token_id
            eos_token_ids = [] if eos is None else [eos]
        self.eos_token_ids = frozenset(eos_token_ids)
        self.graphs = None
        if cfg.graphs and self.backend.runtime.graph_capture and not self.backend.strict:
            self.graphs = StepGraphs(model, self.kv, self.sched.req_to_token, cfg.max_running,
                                     self.drafts.graph_drafter)
            # A step with graphs runs 1, 2, 4, ... or D nodes: the sizes the policy picks among.
            self.graphs.capture_all(tree_sizes(self.tree_size))
            self.sched.prefill_cap = self.graphs.prefill_capacity
        buckets = self.graphs.buckets if self.graphs is not None else batch_buckets(cfg.max_running)
        self.policy = SpecPolicy(self.tree_size, cfg.spec_policy, cfg.probe_every, buckets=buckets)
        if self.graphs is not None and self.policy.mode == "auto":
            self.graphs.calibrate(self.policy.costs, self.policy.sizes)
        self.stats = EngineStats()
        self.runner = StepRunner(model, self.kv, self.sched, transfer, self.drafts, self.graphs, self.stats)
        self.post = Postprocessor(self.backend.runtime, self.runner, self.sched, self.drafts, self.policy, self.stats)
        self.loop = OverlapLoop(self.sched, self.drafts, self.policy, self.runner, self.post, self.tree_size,
                                cfg.overlap)
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
        the CPU kernels). Where steps are captured, every admission is a captured prefill
        (:attr:`Scheduler.prefill_cap <ngram_hal.engine.scheduler.Scheduler.prefill_cap>`), and the
        prefill of every shape one may take is captured (:meth:`StepGraphs.capture_prefills`);
        on a device without them, prefills of every row count a serving prefill can specialise
        kernels on run instead (:meth:`compile_prefill_rows`). Where ``params`` samples or
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
        if self.graphs is not None:
            self.graphs.capture_prefills()
        elif not self.backend.runtime.is_host:
            self.compile_prefill_rows(short)
        if self.graphs is not None and (not params.greedy or params.logprobs):
            self.graphs.capture_forwards(tree_sizes(self.tree_size))
        self.backend.runtime.synchronize()
        self.forget_drafts()
        self._restart_counts()
        return time.perf_counter() - start

    def compile_prefill_rows(self, params: SamplingParams) -> None:
        """Prefills of ``2**k - 1`` and ``2**k`` rows, up to ``max_prefill_tokens``, one token each.

        A prefill's row count picks kernel variants that the prompts of :meth:`warm_up`, batched
        their own way, may not reach: a product table's tiling per row bucket, and Triton's
        specialisation of a count of 1 or a multiple of 16. Serving would compile those on first
        use, inside the requests' time. A count past one request's room is split over several
        requests, which one prefill step takes together. ``params`` (greedy or sampling: their
        prefills differ) with one new token."""
        cfg = self.config
        room = cfg.max_context_len - 3 * self.tree_size - 1
        if room < 1:
            return
        vocab = self.model.config.vocab_size
        one = params.model_copy(update={"max_new_tokens": 1})
        counts = sorted({c for k in range(cfg.max_prefill_tokens.bit_length())
                         for c in (2 ** k - 1, 2 ** k) if 0 < c <= cfg.max_prefill_tokens})
        for rows in counts:
            sizes = [room] * (rows // room) + ([rows % room] if rows % room else [])
            self.generate([[(7 * i + 1) % vocab for i in range(n)] for n in sizes], one)

    def _restart_counts(self) -> None:
        """Statistics from zero, and the seeds of unseeded requests drawn from ``config.seed`` again."""
        self.stats.reset()
        self._seeds = torch.Generator().manual_seed(self.config.seed)

    def forget_drafts(self) -> None:
        """A new drafter and speculation policy, as a new engine would have, keeping the captured
        graphs and the step costs the policy measured (they are the device's, not the text's): the
        shared n-gram corpus keeps every output it saw, which must not help later requests that a
        fresh engine would serve without it. A drafter on the device stays: it learns only from its
        own request's tokens, which each prefill writes anew."""
        self.drafts.forget()
        self.policy.forget()

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
        self.post.release([req])
        self._report(req)
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running, in flight or has an output not yet returned."""
        return bool(self.sched.waiting or self.sched.running or self.loop.inflight is not None or self._pending)

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

    def pause(self) -> None:
        """The caller stops stepping for a while (another engine takes its turn on the device):
        the next step's device time starts afresh, so neither the engine's idle time nor the
        policy's step costs count the pause."""
        if self.loop.inflight is not None:
            self.loop.inflight.last_of_run = True
        else:
            self.post.idle()

    def step(self) -> list[RequestOutput]:
        """Run one turn of the loop (:meth:`OverlapLoop.turn <ngram_hal.engine.loop.OverlapLoop.turn>`);
        outputs of requests that advanced. Finished requests leave the engine."""
        outputs, self._pending = self._pending, []
        stepped = self.loop.turn()
        for out in stepped:
            if out.finished:
                self._requests.pop(out.rid, None)
        return outputs + stepped

    def _report(self, req: Request) -> None:
        """A request that finished outside a step (an error at admission, an abort): its final
        output is returned by the next :meth:`step`."""
        self._pending.append(req.final_output())
        self._requests.pop(req.rid, None)

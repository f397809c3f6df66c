"""What the host does with a step's results once they are on the host.

Two levels, which the overlap loop runs at different times (see :mod:`ngram_hal.engine.loop`):
:meth:`Postprocessor.absorb` is the token level (commit, stop tokens, length, the drafter, the
policy's measurements) and :meth:`Postprocessor.outputs` the text level (stop strings,
detokenization, outputs). Both free the requests that finished.
"""

from __future__ import annotations

import time

from ..runtime import Runtime
from ..speculative.sources import DraftSource
from .overlap import InflightStep
from .policy import Acceptance, SpecPolicy
from .request import Request, RequestOutput
from .runner import StepRunner
from .scheduler import Scheduler
from .stats import EngineStats
from .stopping import check_stop_strings, commit_tokens


class Postprocessor:
    """Commits the results of one engine's steps and frees what finished.

    Attributes:
        host_s: the host's work in the last turn of the overlapped loop (its time not waiting for
            the device), which the loop sets; the policy's floor under any step's time.
    """

    def __init__(self, runtime: Runtime, runner: StepRunner, sched: Scheduler, drafts: DraftSource,
                 policy: SpecPolicy, stats: EngineStats):
        self.runtime, self.runner, self.sched = runtime, runner, sched
        self.drafts, self.policy, self.stats = drafts, policy, stats
        self.host_s = 0.0
        self._last_kind: str | None = None
        self._last_end = None

    def idle(self) -> None:
        """Nothing runs now: the wait until the next request is not the device idling between steps."""
        self._last_end = None

    def absorb(self, step: InflightStep, critical: bool) -> None:
        """Token level: wait for ``step``, commit its tokens, apply stop tokens and length, feed the
        drafter; ``critical``: the next step waits for this (nothing is enqueued behind it)."""
        step.wait()
        start = time.perf_counter()
        D = step.stride
        tokens, lens = step.tokens.tolist(), step.lens.tolist()
        if step.kind == "decode":
            self._check_lengths(step.reqs, lens, D)
        shadow = step.shadow.tolist() if step.shadow is not None else None
        offered, records = step.offered, step.records
        if shadow is None and step.kind == "decode" and step.tree_size == 1 and self.policy.mode == "auto":
            shadow, offered, records = self._score_plain(step, tokens, D)
        logprobs = step.logprobs.tolist() if step.logprobs is not None else None
        ended, fed, rows, committed, scored, hits = [], [], 0, 0, 0, 0
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
                if shadow is not None:
                    scored += offered[b]
                    hits += shadow[b]
                if records:
                    records[b].add(offered[b], int(shadow[b]) if shadow is not None else n - 1)
            commit_tokens(r, run, logprobs[b * D:b * D + n] if r.params.logprobs else None)
            if r.finished:
                ended.append(r)
            else:
                fed.append((r.rid, run))
        drafting = time.perf_counter()
        # Where the device is busy with the next step, the drafter records the tokens now, not in the next draft.
        self.drafts.extend(fed, spare=not critical)
        self.stats.draft_s += time.perf_counter() - drafting
        self.release(ended)
        step.absorbed = True
        if step.kind == "decode":
            self.stats.critical_decodes += critical
            if shadow is not None:
                self.stats.shadow_drafts += scored
                self.stats.shadow_hits += hits
        self._observe(step, rows, committed, self._time_device(step))
        self.stats.wait_s += step.wait_s
        elapsed = time.perf_counter() - start
        if critical:
            self.stats.critical_s += elapsed
        else:
            self.stats.process_s += elapsed

    def _check_lengths(self, reqs, lens: list[int], D: int) -> None:
        """Refuse a verify step whose accept_len leaves ``1..D`` for a live request: with none
        committed the request would never advance (a backend bug strict mode reports at the op)."""
        bad = next(((r.rid, n) for r, n in zip(reqs, lens) if not r.finished and not 1 <= n <= D), None)
        if bad is not None:
            name = self.runner.backend.name
            raise RuntimeError(f"backend '{name}': a verify step committed {bad[1]} tokens for request {bad[0]} "
                               f"(accept_len must lie in 1..{D}); check the backend with `ngram-hal conformance "
                               f"--backend {name}`")

    def outputs(self, step: InflightStep, hidden: bool) -> list[RequestOutput]:
        """Text level: stop strings and detokenization, the outputs of the step's requests
        (final ones for those that finished, which are freed); ``hidden``: the device is busy
        with the next step meanwhile."""
        start = time.perf_counter()
        outputs, ended = [], []
        for r in step.reqs:
            if r.reported:
                continue
            check_stop_strings(r)
            if r.finished:
                ended.append(r)
                outputs.append(r.final_output())
            elif r.emitted_tokens < len(r.output_ids):
                outputs.append(r.take_output())
        self.release(ended)
        elapsed = time.perf_counter() - start
        if hidden:
            self.stats.process_s += elapsed
        else:
            self.stats.critical_s += elapsed
        return outputs

    def _score_plain(self, step: InflightStep, tokens: list[int], stride: int
                     ) -> tuple[list[int] | None, list[int], list[Acceptance]]:
        """A plain step of a host drafter under ``auto``: each request's first draft (drafted now,
        from the tokens before the step's) against the token the step committed, so acceptance
        follows the text while no step speculates. ``(hits, offered, records)``, the records those
        drafts are scored in (of their match lengths now, where the step launched before the
        drafter had the tokens before it); or (None, the step's offered, its records) where the
        source scores plain steps itself or drafts nothing."""
        live = [b for b, r in enumerate(step.reqs) if not r.finished]
        rids = [step.reqs[b].rid for b in live]
        start = time.perf_counter()
        guesses = self.drafts.first_drafts(rids)
        matches = self.drafts.match_lengths(rids) if guesses is not None else None
        self.stats.draft_s += time.perf_counter() - start
        if guesses is None:
            return None, step.offered, step.records
        hits, offered, records = [0] * len(step.reqs), [0] * len(step.reqs), list(step.records)
        scored = self.policy.acceptances([step.reqs[b] for b in live], matches) if matches is not None else None
        for i, (b, guess) in enumerate(zip(live, guesses)):
            offered[b] = int(guess >= 0)
            hits[b] = int(guess == tokens[b * stride])
            if scored is not None:
                records[b] = scored[i]
        return hits, offered, records

    def release(self, reqs: list[Request]) -> None:
        """Drop finished requests from the batch and the relay, and free their rows and slots."""
        held = [r for r in reqs if r.row >= 0]
        if not held:
            return
        gone = set(map(id, held))
        running = self.sched.running
        keep = [i for i, r in enumerate(running) if id(r) not in gone]
        if len(keep) < len(running):
            self.runner.drop(keep)
        rids = [r.rid for r in held]
        self.drafts.erase(rids)
        self.policy.drop(rids)
        self.sched.release(held)

    def _time_device(self, step: InflightStep) -> float | None:
        """Add the step's device time, and the device's idle time since the previous step ended
        (a prefill's own seconds also to ``prefill_s``: its device time, or its launch's where the
        runtime is the host's); returns the device seconds from the previous step's end to this
        one's (None where the runtime does not time, or no step ran just before: the engine was
        idle or paused in between)."""
        busy = step.launch_s if self.runtime.is_host else step.begin.elapsed_time(step.event) / 1e3
        if step.kind == "prefill":
            self.stats.prefill_s += busy
        if self.runtime.is_host:
            return None
        self.stats.device_busy_s += busy
        interval = None
        if self._last_end is not None:
            self.stats.device_idle_s += max(0.0, self._last_end.elapsed_time(step.begin) / 1e3)
            interval = self._last_end.elapsed_time(step.event) / 1e3
        self._last_end = None if step.last_of_run else step.event
        return interval

    def _observe(self, step: InflightStep, rows: int, committed: int, interval: float | None) -> None:
        """Feed a finished step to the statistics and the speculation policy. A step's time is the
        device's ``interval`` since the previous step ended where the runtime times it (None
        after a prefill); on a host runtime, where a step computes inside its launch, the launch's
        host time (drafting included). The policy also gets :attr:`host_s`, the floor under any
        step's time where the host sets the pace."""
        if step.kind == "decode":
            self.stats.decode_tokens += committed
            self.stats.decode_rows += rows
            seconds = step.launch_s if self.runtime.is_host else interval
            if rows and self._last_kind == "decode":
                self.policy.observe(step.bucket, step.tree_size, seconds, step.context, self.host_s)
        self._last_kind = step.kind

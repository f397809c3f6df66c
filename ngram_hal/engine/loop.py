"""The overlap loop: one turn of it per :meth:`Engine.step <ngram_hal.engine.engine.Engine.step>`.

What the loop overlaps. Each launched step copies its results (committed tokens, their counts,
logprobs) into host buffers and records an event; the device-side state the next step needs
(last tokens, lengths) stays on the device in an :class:`~ngram_hal.speculative.relay.OverlapRelay`.
The host blocks only in that event's ``synchronize()``. One :meth:`OverlapLoop.turn`:

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

import time

from ..speculative.sources import DraftSource
from .overlap import InflightStep
from .policy import Acceptance, SpecPolicy
from .postprocess import Postprocessor
from .request import RequestOutput
from .runner import StepRunner
from .scheduler import Scheduler


class OverlapLoop:
    """Launches one engine's steps and processes their results, a turn at a time.

    Args:
        sched, drafts, policy, runner, post: the engine's scheduler, draft source, speculation
            policy, step runner and postprocessor.
        tree_size: D, the engine's tree size (1 without speculation).
        overlap: enqueue step t+1 before processing step t (the module docstring); else each turn
            launches a step, waits for it and processes it.

    Attributes:
        inflight: the step the last turn launched, whose results are not processed yet, or None.
    """

    def __init__(self, sched: Scheduler, drafts: DraftSource, policy: SpecPolicy, runner: StepRunner,
                 post: Postprocessor, tree_size: int, overlap: bool):
        self.sched, self.drafts, self.policy, self.runner, self.post = sched, drafts, policy, runner, post
        self.tree_size, self.overlap = tree_size, overlap
        self.inflight: InflightStep | None = None

    def turn(self) -> list[RequestOutput]:
        """One turn (see the module docstring): the outputs of the step it processed, finished
        requests' included (none when no step was processed)."""
        if not self.overlap:
            step = self._launch()
            if step is None:
                return []
            self.post.absorb(step, critical=True)
            return self.post.outputs(step, hidden=False)
        start = time.perf_counter()
        prev, self.inflight = self.inflight, None
        if prev is not None and self._drafts_next():
            self.post.absorb(prev, critical=True)
        self.inflight = self._launch()
        if prev is None:
            return []
        if not prev.absorbed:
            self.post.absorb(prev, critical=False)
        outputs = self.post.outputs(prev, hidden=self.inflight is not None)
        self.post.host_s = time.perf_counter() - start - prev.wait_s
        return outputs

    def _drafts_next(self) -> bool:
        """Whether the next step needs the previous one's tokens on the host: a speculative step
        drafted on the host drafts from them. A step drafted on the device, or one the policy runs
        with one node (a plain decode step), does not, so it overlaps like a plain one; so does
        admission, which, as without speculation, sees the seats and slots a step frees one turn
        later (a request that finished in the step in flight costs the next step one row)."""
        if self.tree_size == 1 or self.drafts.ahead or self._drafter_busy():
            return False
        if not self.sched.running:
            return True
        return self.policy.peek(*self._batch(self.sched.running)) > 1

    def _batch(self, reqs, busy: bool = False) -> tuple[int, list[Acceptance], float]:
        """What the policy reads for ``reqs`` (:meth:`SpecPolicy.batch`), with the draft source's
        match lengths (as of the tokens it has recorded) in ``auto``, unless the drafter is
        ``busy`` recording (asking would wait for it)."""
        ask = self.policy.mode == "auto" and not busy
        return self.policy.batch(reqs, self.drafts.match_lengths([r.rid for r in reqs]) if ask else None)

    def _drafter_busy(self) -> bool:
        """In ``auto`` on a device: the drafter still records in the background (a batch of
        prompts); steps run plain until it is done rather than wait for it (``always`` waits, and
        so does ``auto`` on a host runtime, whose steps would take the recording's cores)."""
        return self.policy.mode == "auto" and not self.post.runtime.is_host and self.drafts.busy

    def _launch(self) -> InflightStep | None:
        """Enqueue the next step: a prefill of the requests admitted now, else a verify step of
        the running batch at the tree size the policy chooses; None when nothing runs."""
        admitted = self.sched.admit()
        if admitted:
            return self.runner.prefill(admitted)
        if not self.sched.running:
            self.post.idle()
            return None
        reqs = list(self.sched.running)
        busy = self._drafter_busy()
        bucket, acceptances, context = self._batch(reqs, busy)
        tree_size = 1 if busy else self.policy.choose(bucket, acceptances, context)
        step = self.runner.decode(reqs, tree_size, bucket, context, score_plain=self.policy.mode == "auto")
        step.records = acceptances
        return step

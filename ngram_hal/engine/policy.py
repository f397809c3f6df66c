"""How many draft nodes the next verify step runs: D always, or (``auto``) the size that a cost
model expects to commit the most tokens per second for the whole batch.

``auto`` weighs two things, both measured while serving.

* **What a step costs.** :class:`StepCosts` keeps the seconds of a verify step by batch bucket
  and tree size. Where steps are captured the engine replays each captured size once per bucket
  when it starts, at two contexts (an eighth and a half of the request table's keys per request:
  :meth:`StepGraphs.calibrate <ngram_hal.engine.graphs.StepGraphs.calibrate>`), so the model knows
  every size before the first request and how its cost grows with the context (tree attention
  reads every key for every node). A step lasts as long as the slower of that and the host's
  work per step (which the engine measures); serving measures each step on the device, between
  the completions of consecutive steps, and shifts every size of the bucket by the median of
  measured minus estimated seconds. On a host runtime, where a step computes inside its launch,
  each size costs the median of its last launches; a size not measured yet costs as much as the
  next smaller size measured (a guess that one step corrects).
* **What a step commits.** An :class:`Acceptance` keeps two rates: how often a first draft is
  accepted (``p_first``), and how often a draft is accepted once the one before it was
  (``p_next``). N-gram drafts are accepted in runs: a request copying its context accepts most of
  a chain once the first draft is right, while the first draft is often wrong, so one rate for
  every draft would undervalue long chains. A step of n nodes is expected to commit
  ``1 + p_first * (1 + p_next + ... + p_next**(n-2))`` tokens of a request. Where the drafter says
  on the host how long a suffix of each request's context its next draft continues (the host
  drafters), the rates are the engine's for drafts of that match length (:data:`MATCH_CLASSES`):
  a longer match is accepted more often and for longer, in every kind of text, and a new request
  starts from what earlier ones measured; a request that matches nothing expects one token. Else
  (drafts made on the device) each request keeps its own rates, over about its last ten steps.
  Only the drafts a step really offered count (a host drafter may find fewer than ``n - 1``). A
  plain step scores each request's first draft against the token it committed: the device
  drafter's, drafted anyway, or a host drafter's, drafted from the tokens before the step's.

The next size is the one with the highest ``sum of every request's expected tokens / step
cost``: throughput of the whole batch, so copy-heavy requests speculate even beside open-ended
ones, while a request that accepts nothing adds about one token to every size alike. Plain
steps run unless the best size beats them by ``margin`` (5%), so timing noise does not make a
batch that gains nothing speculate. After ``probe_every`` plain steps in a row the next step
runs two nodes (the gap doubling, up to eight times, while plain stays best), so that acceptance
follows the text where nothing else scores drafts. Greedy output is unaffected: every
step is exact whatever its size, and sampling draws by position (:mod:`ngram_hal.engine.sampling`).
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Sequence


def tree_sizes(tree_size: int) -> list[int]:
    """The sizes ``auto`` chooses among: 1, the powers of two below ``tree_size``, and ``tree_size``."""
    return sorted({1, tree_size} | {1 << i for i in range(1, tree_size.bit_length()) if 1 << i < tree_size})


class Acceptance:
    """One request's record of accepted drafts, as two rates: of its first drafts, and of the
    drafts after an accepted one. Each verify step is one first-draft trial (a success when the
    first draft is accepted) and, past an accepted first draft, one trial per further draft up to
    the first rejection. Each step first decays every count by ``decay``, so the record follows
    about the last ten steps; a step's many later-draft trials count in full, so a request that
    copies whole chains reaches a ``p_next`` near one, as long chains need."""

    def __init__(self, decay: float = 0.9):
        self.decay = decay
        self.first = [0.0, 0.0]
        self.later = [0.0, 0.0]

    @staticmethod
    def _rate(counts: list[float]) -> float:
        accepted, rejected = counts
        return (accepted + 0.5) / (accepted + rejected + 1.0)

    @property
    def p_first(self) -> float:
        """The estimated probability that a step's first draft is accepted (one pseudo-trial at
        one half before any)."""
        return self._rate(self.first)

    @property
    def p_next(self) -> float:
        """The estimated probability that a draft is accepted, given the one before it was."""
        return self._rate(self.later)

    def add(self, offered: int, accepted: int) -> None:
        """A verify step offered ``offered`` drafts and the request accepted ``accepted`` of them."""
        if offered < 1:
            return
        accepted = min(accepted, offered)
        for counts in (self.first, self.later):
            counts[0] *= self.decay
            counts[1] *= self.decay
        if accepted < 1:
            self.first[1] += 1.0
            return
        self.first[0] += 1.0
        self.later[0] += accepted - 1
        if accepted < offered:
            self.later[1] += 1.0

    def expected_tokens(self, drafts: int) -> float:
        """Tokens a step commits with ``drafts`` drafts offered:
        ``1 + p_first * (1 + p_next + ... + p_next**(drafts - 1))``."""
        return expected_tokens(self.p_first, self.p_next, drafts)


class NoDrafts(Acceptance):
    """The rates of a request whose drafter matches nothing: it commits one token a step, and a
    step offers it nothing to record."""

    p_first = p_next = 0.0

    def add(self, offered: int, accepted: int) -> None:
        pass


NO_DRAFTS = NoDrafts()

MATCH_CLASSES = (1, 2, 3, 4, 8)
"""The shortest match length of each class of drafts the policy keeps rates for: 1, 2, 3, 4-7 and
8 or more tokens. Over the greedy SmolLM2 outputs of the workload's prompts, at every position,
prompt lookup's first draft was accepted at 18 % after a 1-token match, 46-52 % after 2, 65-74 %
after 3, 76-90 % after 4-7 and 94-96 % after 8 or more (``bench/bench_policy_replay.py``)."""


def match_class(length: int) -> int | None:
    """The index in :data:`MATCH_CLASSES` of a match of ``length`` tokens; None for 0 (no match)."""
    return None if length < 1 else bisect.bisect_right(MATCH_CLASSES, length) - 1


def expected_tokens(p_first: float, p_next: float, drafts: int) -> float:
    """``1 + p_first * (1 + p_next + ... + p_next**(drafts - 1))``: the tokens a step of ``drafts``
    drafts commits for a request of those rates (:class:`Acceptance`)."""
    if drafts < 1:
        return 1.0
    run = float(drafts) if p_next >= 1.0 else (1.0 - p_next ** drafts) / (1.0 - p_next)
    return 1.0 + p_first * run


class StepCosts:
    """Seconds of a verify step by (batch bucket, tree size) and context.

    A step takes as long as the slower of the device and the host: the device runs it while the
    host commits, reports and enqueues the steps around it. So a calibrated size (replays of its
    captured step, at two or more contexts) costs the larger of its calibration at the step's
    context (the mean keys per request before the tree: piecewise linear between the calibrated
    contexts, extended linearly past them) and the host's time per step (the median of the
    bucket's last ``window`` steps), plus the bucket's offset: the median, over those steps, of
    measured seconds minus that estimate (what the replays leave out), the sum never less than a
    tenth of the calibration. Every size of a bucket moves with what serving measures, so the
    size run most is not the only one that looks dear, and where the host sets the pace every
    size costs about the same. A size never calibrated (a host runtime) costs the median of its
    own last ``window`` measured steps, whatever the context.
    """

    def __init__(self, window: int = 5):
        self.window = window
        self._steps: dict[tuple[int, int], deque[float]] = {}
        self._medians: dict[tuple[int, int], float] = {}
        self._calibrated: dict[tuple[int, int], dict[int, float]] = {}
        self._residuals: dict[int, deque[float]] = {}
        self._offsets: dict[int, float] = {}
        self._hosts: dict[int, deque[float]] = {}
        self._host: dict[int, float] = {}

    def add(self, bucket: int, tree_size: int, seconds: float, context: float = 0.0, host: float = 0.0) -> None:
        """A step of tree size ``tree_size`` over a batch in ``bucket``, its requests holding
        ``context`` keys on average, took ``seconds``, while the host worked ``host`` seconds on
        the engine's loop."""
        if not seconds > 0:
            return
        calibrated = self._calibration(bucket, tree_size, context)
        if calibrated is not None:
            hosts = self._hosts.setdefault(bucket, deque(maxlen=self.window))
            hosts.append(host)
            self._host[bucket] = statistics.median(hosts)
            residuals = self._residuals.setdefault(bucket, deque(maxlen=self.window))
            residuals.append(seconds - max(host, calibrated))
            self._offsets[bucket] = statistics.median(residuals)
            return
        samples = self._steps.setdefault((bucket, tree_size), deque(maxlen=self.window))
        samples.append(seconds)
        self._medians[(bucket, tree_size)] = statistics.median(samples)

    def calibrate(self, bucket: int, tree_size: int, seconds: float, context: int = 0) -> None:
        """A cost measured apart from serving (a replay of the captured step whose requests read
        ``context`` keys each)."""
        if seconds > 0:
            self._calibrated.setdefault((bucket, tree_size), {})[context] = seconds

    def _calibration(self, bucket: int, tree_size: int, context: float) -> float | None:
        points = self._calibrated.get((bucket, tree_size))
        if not points:
            return None
        ctx = sorted(points)
        if len(ctx) == 1:
            return points[ctx[0]]
        i = next((k for k in range(1, len(ctx) - 1) if context < ctx[k]), len(ctx) - 1)
        lo, hi = ctx[i - 1], ctx[i]
        cost = points[lo] + (points[hi] - points[lo]) * (context - lo) / (hi - lo)
        return max(cost, 0.1 * points[ctx[0]])

    def measured(self, bucket: int, tree_size: int, context: float = 0.0) -> float | None:
        """The known cost of the key at ``context``, or None."""
        calibrated = self._calibration(bucket, tree_size, context)
        if calibrated is not None:
            paced = max(calibrated, self._host.get(bucket, 0.0))
            return max(paced + self._offsets.get(bucket, 0.0), 0.1 * calibrated)
        return self._medians.get((bucket, tree_size))

    def estimate(self, bucket: int, tree_size: int, sizes: Sequence[int], context: float = 0.0) -> float | None:
        """The key's cost at ``context``, or (unknown) that of the largest smaller size in
        ``sizes`` known for the bucket; None when no size of the bucket is known."""
        for n in sorted((s for s in sizes if s <= tree_size), reverse=True):
            cost = self.measured(bucket, n, context)
            if cost is not None:
                return cost
        return None

    def table(self, context: float = 0.0) -> dict[str, dict[str, float]]:
        """Every known cost at ``context`` as ``{bucket: {tree_size: seconds}}`` (strings, for a JSON report)."""
        out: dict[str, dict[str, float]] = {}
        for bucket, tree_size in sorted(set(self._calibrated) | set(self._medians)):
            out.setdefault(str(bucket), {})[str(tree_size)] = self.measured(bucket, tree_size, context)
        return out


class SpecPolicy:
    """Picks the draft-tree size of each verify step.

    Args:
        tree_size: D, the largest tree size.
        mode: ``"always"`` (every step uses D) or ``"auto"`` (see the module docstring).
        probe_every: in ``auto``, plain steps in a row after which a step of two nodes runs; the
            gap doubles, up to ``8 * probe_every``, while such probes leave plain steps best.
        margin: how much more throughput than plain steps speculation must promise to be chosen
            (0.05: 5%).
        costs: the step costs to start from.
        buckets: the batch buckets step costs are kept under (a batch counts as the smallest
            bucket that holds it).
        match_decay: the decay of the records by match class (per request-step recorded): 0.97
            follows about the last thirty.

    :meth:`batch` gives what :meth:`peek` and :meth:`choose` read for a batch of requests: the
    :class:`Acceptance` each request's next step is scored by and adds to. It keeps one per
    match class (:attr:`by_match`) where the drafter says its match lengths, else one per
    request (:attr:`records`, by request id, until :meth:`drop`).
    """

    def __init__(self, tree_size: int, mode: str = "always", probe_every: int = 16, margin: float = 0.05,
                 costs: StepCosts | None = None, buckets: Sequence[int] = (1,), match_decay: float = 0.97):
        if mode not in ("always", "auto"):
            raise ValueError(f"mode: expected 'always' or 'auto', got {mode!r}")
        if not margin >= 0:
            raise ValueError(f"margin: expected a number >= 0, got {margin!r}")
        if not 0 < match_decay <= 1:
            raise ValueError(f"match_decay: expected a number in (0, 1], got {match_decay!r}")
        self.tree_size = tree_size
        self.mode = mode
        self.probe_every = probe_every
        self.margin = margin
        self.match_decay = match_decay
        self.costs = costs if costs is not None else StepCosts()
        self.sizes = tree_sizes(tree_size) if mode == "auto" else [tree_size]
        self.buckets = sorted(buckets)
        self.forget()

    def forget(self) -> None:
        """Start again as a new policy would: no acceptance records, no steps chosen; the step
        costs stay (they are the device's, not the text's)."""
        self.records: dict[str, Acceptance] = {}
        self.by_match = [Acceptance(self.match_decay) for _ in MATCH_CLASSES]
        self.chosen = {n: 0 for n in self.sizes}
        self._plain_run = 0
        self._probe_gap = self.probe_every

    def batch(self, requests: Sequence, matches: Sequence[int] | None = None) -> tuple[int, list[Acceptance], float]:
        """``(bucket, acceptances, context)`` for a batch of requests (objects with ``rid`` and
        ``seq_len``): the bucket of its size, the record each request's next step is scored by
        (that of its match class where ``matches``, the drafter's match lengths, are given; else
        its own, a new one at its first verify step) and the mean keys per request before the
        step's trees. In ``always``, which reads neither, no records and context 0."""
        bucket = next(b for b in self.buckets if b >= len(requests))
        if self.mode != "auto":
            return bucket, [], 0.0
        return bucket, self.acceptances(requests, matches), sum(r.seq_len for r in requests) / len(requests)

    def acceptances(self, requests: Sequence, matches: Sequence[int] | None = None) -> list[Acceptance]:
        """The record each of ``requests`` is scored by, as :meth:`batch` gives them."""
        if matches is not None:
            classes = [match_class(n) for n in matches]
            return [NO_DRAFTS if c is None else self.by_match[c] for c in classes]
        records = self.records
        for r in requests:
            if r.rid not in records:
                records[r.rid] = Acceptance()
        return [records[r.rid] for r in requests]

    def drop(self, rids: Sequence[str]) -> None:
        """Forget the records of finished requests."""
        for rid in rids:
            self.records.pop(rid, None)

    def rate(self, bucket: int, tree_size: int, requests: Sequence[Acceptance], context: float = 0.0) -> float | None:
        """Expected tokens per second of a step of tree size ``tree_size`` over ``requests`` in ``bucket``
        holding ``context`` keys each on average; None while no cost of the bucket is known."""
        return self._rate(bucket, tree_size, [(a.p_first, a.p_next) for a in requests], context)

    def _rate(self, bucket: int, tree_size: int, rates: list[tuple[float, float]], context: float) -> float | None:
        cost = self.costs.estimate(bucket, tree_size, self.sizes, context)
        if cost is None:
            return None
        return sum(expected_tokens(first, later, tree_size - 1) for first, later in rates) / cost

    def peek(self, bucket: int, requests: Sequence[Acceptance], context: float = 0.0) -> int:
        """The size :meth:`choose` would return now for ``requests`` in ``bucket`` holding
        ``context`` keys each on average, choosing nothing."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        if self._plain_run >= self._probe_gap:
            return self.sizes[1]
        if self.costs.measured(bucket, 1, context) is None:
            return 1
        pairs = [(a.p_first, a.p_next) for a in requests]
        rates = {n: self._rate(bucket, n, pairs, context) for n in self.sizes}
        best = max(self.sizes, key=rates.__getitem__)
        return best if rates[best] >= rates[1] * (1 + self.margin) else 1

    def choose(self, bucket: int, requests: Sequence[Acceptance], context: float = 0.0) -> int:
        """The draft-tree size of the next verify step of ``requests`` in batch ``bucket``, holding
        ``context`` keys each on average."""
        tree_size = self.peek(bucket, requests, context)
        if tree_size == 1:
            self._plain_run += 1
        else:
            probe = self._plain_run >= self._probe_gap
            self._probe_gap = min(2 * self._probe_gap, 8 * self.probe_every) if probe else self.probe_every
            self._plain_run = 0
        self.chosen[tree_size] += 1
        return tree_size

    def observe(self, bucket: int, tree_size: int, seconds: float | None, context: float = 0.0,
                host: float = 0.0) -> None:
        """A verify step ran trees of size ``tree_size`` (after any cut to the drafts' size) over a
        batch in ``bucket`` holding ``context`` keys each on average, in ``seconds``: the device
        time from the previous decode step's completion to this one's, or None when that is no
        clean sample (a prefill ran between); ``host`` is the host's work per turn of the loop
        meanwhile (its time not spent waiting for the device).

        Where steps overlap, the completions must be read on the device: the host learns of a
        step's completion only when it waits for it, which for an overlapped step is after it
        has launched the next one, so host times move the launch cost of a step onto the one
        before it."""
        if seconds is not None:
            self.costs.add(bucket, tree_size, seconds, context, host)

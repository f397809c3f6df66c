"""How many draft nodes the next verify step runs: D always, or (``auto``) the size that a cost
model expects to commit the most tokens per second for the whole batch.

``auto`` weighs two things, both measured while serving.

* **What a step costs.** :class:`StepCosts` keeps the seconds of a verify step by batch bucket
  and tree size (the median of its last few steps): on the device, between the completions of
  consecutive steps, so host overheads count too; on a host runtime, where a step computes
  inside its launch, the launch's time. Where steps are captured the engine replays each
  captured size once per bucket when it starts (:meth:`StepCosts.calibrate`), so the model knows
  every size before the first request; a size not measured yet costs as much as the next smaller
  size measured (a guess that one step corrects).
* **What a step commits.** Every request keeps an :class:`Acceptance` of two rates, over about
  its last ten steps and drafts: how often its first draft is accepted (``p_first``), and how often
  a draft is accepted once the one before it was (``p_next``). N-gram drafts are accepted in runs:
  a request copying its context accepts most of a chain once the first draft is right, while the
  first draft is often wrong, so one rate for every draft would undervalue long chains. Only the
  drafts a step really offered count (a host drafter may find fewer than ``n - 1``; with the device
  drafter a plain step offers each request's first draft, drafted anyway, and scores it against
  the token it committed). A step of n nodes is then expected to commit
  ``1 + p_first * (1 + p_next + ... + p_next**(n-2))`` tokens of the request.

The next size is the one with the highest ``sum of every request's expected tokens / step
cost``: throughput of the whole batch, so copy-heavy requests speculate even beside open-ended
ones, while a request that accepts nothing adds about one token to every size alike. The
smallest size within ``margin`` (5%) of the best is taken, and plain steps unless speculation
beats them by the margin; where the host sets the pace every size costs about the same and
timing noise would otherwise pick larger trees. After ``probe_every`` plain steps in a row the
next step runs two nodes (the gap doubling, up to eight times, while plain stays best), so that
acceptance follows the text where nothing else scores drafts. Greedy output is unaffected: every
step is exact whatever its size, and sampling draws by position (:mod:`ngram_hal.engine.sampling`).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence


def tree_sizes(num_nodes: int) -> list[int]:
    """The sizes ``auto`` chooses among: 1, the powers of two below ``num_nodes``, and ``num_nodes``."""
    return sorted({1, num_nodes} | {1 << i for i in range(1, num_nodes.bit_length()) if 1 << i < num_nodes})


class Acceptance:
    """One request's record of accepted drafts, as two rates: of its first drafts, and of the
    drafts after an accepted one. Each verify step is one first-draft trial (a success when the
    first draft is accepted) and, past an accepted first draft, one trial per further draft up to
    the first rejection. Each trial decays the counts of its own rate by ``decay`` (so the record
    follows the last ten or so steps and drafts)."""

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

    def _trials(self, counts: list[float], successes: int, failure: bool) -> None:
        """``successes`` successful trials in a row, then one failed one where ``failure``: each
        trial decays both counts and adds one to its own (the closed form of that loop)."""
        if successes:
            kept = self.decay ** successes
            gained = successes if self.decay == 1.0 else (1.0 - kept) / (1.0 - self.decay)
            counts[0] = kept * counts[0] + gained
            counts[1] *= kept
        if failure:
            counts[0] *= self.decay
            counts[1] = self.decay * counts[1] + 1.0

    def add(self, offered: int, accepted: int) -> None:
        """A verify step offered ``offered`` drafts and the request accepted ``accepted`` of them."""
        if offered < 1:
            return
        accepted = min(accepted, offered)
        self._trials(self.first, int(accepted >= 1), accepted < 1)
        if accepted >= 1:
            self._trials(self.later, accepted - 1, accepted < offered)

    def expected_tokens(self, drafts: int) -> float:
        """Tokens a step commits with ``drafts`` drafts offered:
        ``1 + p_first * (1 + p_next + ... + p_next**(drafts - 1))``."""
        return expected_tokens(self.p_first, self.p_next, drafts)


def expected_tokens(p_first: float, p_next: float, drafts: int) -> float:
    """``1 + p_first * (1 + p_next + ... + p_next**(drafts - 1))``: the tokens a step of ``drafts``
    drafts commits for a request of those rates (:class:`Acceptance`)."""
    if drafts < 1:
        return 1.0
    run = float(drafts) if p_next >= 1.0 else (1.0 - p_next ** drafts) / (1.0 - p_next)
    return 1.0 + p_first * run


class StepCosts:
    """Seconds of a verify step by (batch bucket, tree size): the median of the last ``window``
    measured steps, or the calibration value before any."""

    def __init__(self, window: int = 5):
        self.window = window
        self._steps: dict[tuple[int, int], deque[float]] = {}
        self._medians: dict[tuple[int, int], float] = {}
        self._calibrated: dict[tuple[int, int], float] = {}

    def add(self, bucket: int, nodes: int, seconds: float) -> None:
        """A step of ``nodes`` nodes per request over a batch in ``bucket`` took ``seconds``."""
        if seconds > 0:
            samples = self._steps.setdefault((bucket, nodes), deque(maxlen=self.window))
            samples.append(seconds)
            self._medians[(bucket, nodes)] = statistics.median(samples)

    def calibrate(self, bucket: int, nodes: int, seconds: float) -> None:
        """A cost measured apart from serving (a replay of the captured step), used until steps are."""
        if seconds > 0:
            self._calibrated[(bucket, nodes)] = seconds

    def measured(self, bucket: int, nodes: int) -> float | None:
        """The known cost of the key, or None."""
        found = self._medians.get((bucket, nodes))
        return found if found is not None else self._calibrated.get((bucket, nodes))

    def estimate(self, bucket: int, nodes: int, sizes: Sequence[int]) -> float | None:
        """The key's cost, or (unknown) that of the largest smaller size in ``sizes`` known for the
        bucket; None when no size of the bucket is known."""
        for n in sorted((s for s in sizes if s <= nodes), reverse=True):
            cost = self.measured(bucket, n)
            if cost is not None:
                return cost
        return None


class SpecPolicy:
    """Picks the draft-tree size of each verify step.

    Args:
        num_nodes: D, the largest speculative tree.
        mode: ``"always"`` (every step uses D) or ``"auto"`` (see the module docstring).
        probe_every: in ``auto``, plain steps in a row after which a step of two nodes runs; the
            gap doubles, up to ``8 * probe_every``, while such probes leave plain steps best.
        margin: how much more throughput a larger size must promise to be chosen (0.05: 5%).
        costs: the step costs to start from (those of an earlier policy of the same engine).
    """

    def __init__(self, num_nodes: int, mode: str = "always", probe_every: int = 16, margin: float = 0.05,
                 costs: StepCosts | None = None):
        if mode not in ("always", "auto"):
            raise ValueError(f"mode: expected 'always' or 'auto', got {mode!r}")
        if not margin >= 0:
            raise ValueError(f"margin: expected a number >= 0, got {margin!r}")
        self.num_nodes = num_nodes
        self.mode = mode
        self.probe_every = probe_every
        self.margin = margin
        self.costs = costs if costs is not None else StepCosts()
        self.sizes = tree_sizes(num_nodes) if mode == "auto" else [num_nodes]
        self.chosen = {n: 0 for n in self.sizes}
        self._plain_run = 0
        self._probe_gap = probe_every

    def rate(self, bucket: int, nodes: int, requests: Sequence[Acceptance]) -> float | None:
        """Expected tokens per second of a step of ``nodes`` nodes over ``requests`` in ``bucket``;
        None while no cost of the bucket is known."""
        return self._rate(bucket, nodes, [(a.p_first, a.p_next) for a in requests])

    def _rate(self, bucket: int, nodes: int, rates: list[tuple[float, float]]) -> float | None:
        cost = self.costs.estimate(bucket, nodes, self.sizes)
        if cost is None:
            return None
        return sum(expected_tokens(first, later, nodes - 1) for first, later in rates) / cost

    def peek(self, bucket: int, requests: Sequence[Acceptance]) -> int:
        """The size :meth:`choose` would return now for ``requests`` in ``bucket``, choosing nothing."""
        if len(self.sizes) == 1:
            return self.sizes[0]
        if self._plain_run >= self._probe_gap:
            return self.sizes[1]
        if self.costs.measured(bucket, 1) is None:
            return 1
        pairs = [(a.p_first, a.p_next) for a in requests]
        rates = {n: self._rate(bucket, n, pairs) for n in self.sizes}
        top = max(rates.values())
        return next(n for n in self.sizes if rates[n] * (1 + self.margin) >= top)

    def choose(self, bucket: int, requests: Sequence[Acceptance]) -> int:
        """The draft-tree size of the next verify step of ``requests`` in batch ``bucket``."""
        nodes = self.peek(bucket, requests)
        if nodes == 1:
            self._plain_run += 1
        else:
            probe = self._plain_run >= self._probe_gap
            self._probe_gap = min(2 * self._probe_gap, 8 * self.probe_every) if probe else self.probe_every
            self._plain_run = 0
        self.chosen[nodes] += 1
        return nodes

    def observe(self, bucket: int, nodes: int, seconds: float | None) -> None:
        """A verify step ran ``nodes`` nodes per request (after any cut to the drafts' size) over a
        batch in ``bucket`` in ``seconds``: the device time from the previous decode step's
        completion to this one's, or None when that is no clean sample (a prefill ran between).

        Where steps overlap, the completions must be read on the device: the host learns of a
        step's completion only when it waits for it, which for an overlapped step is after it
        has launched the next one, so host times move the launch cost of a step onto the one
        before it."""
        if seconds is not None:
            self.costs.add(bucket, nodes, seconds)

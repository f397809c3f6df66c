"""How many draft nodes a verify step runs: D always, or (``auto``) the size measured fastest.

A verify step over n nodes per request costs more than a plain decode step, and pays off only
when enough drafts are accepted; which n wins depends on the batch (B*n rows go through the
model), the device and the text. The ``auto`` policy measures while serving: for each tree size
of 1, 2, 4, ... up to D it keeps a moving average of the tokens committed per request per step
and the median time per request per step over its last few steps (the time between the
completions of consecutive decode steps, so host overheads count too: the engine times it on the
device where it can, see :meth:`observe`), and runs the size with the highest estimated tokens
per second. The tokens it counts are those of the step's slowest request (the fewest any request
committed): a batch is done when its slowest request is, so a size that makes every step dearer
pays only when it speeds up all of the batch, not just its copy-heavy requests. (With one
request that is simply its tokens per step.)

A size counts as faster only by a margin: the best size is the smallest whose rate is within
``margin`` (5%) of the highest. Where the host sets the pace (large batches), every size's time
per step is about the same and their rates differ by timing noise; without the margin the choice
would wander to larger trees that commit no more and cost the device more.

It searches locally, from the plain step up: it starts at size 1 and tries the next larger size
once the best size is known, climbing while each size beats the one below it, so a batch where
speculation loses pays for one trial of size 2, not of every size. Every so often it runs one
of the best size's neighbours instead (a probe; the one run least recently), so the choice
follows the workload (a copy-heavy stretch starts, a batch grows). Probes cost: while the best
size stays the same, the gap between probes doubles from ``probe_every`` up to
``max_probe_every`` steps; when the best size changes, or a probe finds its size faster than
estimated before (by a tenth or more), it drops back to ``probe_every``. Greedy output is
unaffected: every step is exact whatever size it uses.
"""

from __future__ import annotations

import statistics
from collections import deque


class _Average:
    """An exponential moving average that is None until its first sample."""

    def __init__(self, decay: float):
        self.decay = decay
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample


class _Median:
    """The median of the last ``window`` samples (None before the first): one stalled step (a
    collection, a page fault, another process) does not move it."""

    def __init__(self, window: int):
        self.samples: deque[float] = deque(maxlen=window)

    def add(self, sample: float) -> None:
        self.samples.append(sample)

    @property
    def value(self) -> float | None:
        return statistics.median(self.samples) if self.samples else None


def tree_sizes(num_nodes: int) -> list[int]:
    """The sizes ``auto`` chooses among: 1, the powers of two below ``num_nodes``, and ``num_nodes``."""
    return sorted({1, num_nodes} | {1 << i for i in range(1, num_nodes.bit_length()) if 1 << i < num_nodes})


class SpecPolicy:
    """Picks the draft-tree size of each verify step.

    Args:
        num_nodes: D, the largest speculative tree.
        mode: ``"always"`` (every step uses D) or ``"auto"`` (the size in :func:`tree_sizes`
            measured fastest).
        probe_every: in ``auto``, the fewest steps between two probes of the size measured least
            recently (the gap while the best size keeps changing).
        max_probe_every: the most steps between two probes (the gap once the best size has held);
            default ``8 * probe_every``.
        decay: weight of the past in the moving average of the tokens per step.
        window: steps of each size whose median time is its time per step.
        margin: how much faster than every smaller size a size must be estimated to be chosen
            (0.05: 5%).
    """

    def __init__(self, num_nodes: int, mode: str = "always", probe_every: int = 16, decay: float = 0.7,
                 max_probe_every: int | None = None, window: int = 5, margin: float = 0.05):
        if mode not in ("always", "auto"):
            raise ValueError(f"mode: expected 'always' or 'auto', got {mode!r}")
        if not margin >= 0:
            raise ValueError(f"margin: expected a number >= 0, got {margin!r}")
        self.num_nodes = num_nodes
        self.mode = mode
        self.margin = margin
        self.probe_every = probe_every
        self.max_probe_every = max(probe_every, max_probe_every if max_probe_every is not None else 8 * probe_every)
        self._gap = probe_every
        self._next_probe = probe_every
        self._best: int | None = None
        self.sizes = tree_sizes(num_nodes) if mode == "auto" else [num_nodes]
        self._tokens = {n: _Average(decay) for n in self.sizes}
        self._seconds = {n: _Median(window) for n in self.sizes}
        self._last_run = {n: 0 for n in self.sizes}
        self._steps = 0
        self.chosen = {n: 0 for n in self.sizes}

    def rate(self, nodes: int) -> float | None:
        """Estimated tokens per request-second with ``nodes``, or None before it has been measured."""
        tokens, seconds = self._tokens[nodes].value, self._seconds[nodes].value
        if tokens is None or seconds is None or seconds <= 0:
            return None
        return tokens / seconds

    def _decide(self) -> tuple[int, int | None, bool]:
        """The next size, the best size measured (None before any) and whether the next size is a
        probe, from the state as it is."""
        if len(self.sizes) == 1:
            return self.sizes[0], None, False
        measured = [n for n in self.sizes if self.rate(n) is not None]
        if not measured:
            return self.sizes[0], None, False
        top = max(self.rate(n) for n in measured)
        best = next(n for n in measured if self.rate(n) * (1 + self.margin) >= top)
        i = self.sizes.index(best)
        above = self.sizes[i + 1] if i + 1 < len(self.sizes) else None
        if above is not None and self.rate(above) is None:
            return above, best, False
        if best == self._best and self._steps + 1 >= self._next_probe:
            neighbours = self.sizes[max(i - 1, 0):i] + self.sizes[i + 1:i + 2]
            return min(neighbours, key=self._last_run.__getitem__), best, True
        return best, best, False

    def peek(self) -> int:
        """The size :meth:`choose` would return now, without choosing it."""
        return self._decide()[0]

    def choose(self) -> int:
        """The draft-tree size of the next verify step."""
        nodes, best, probe = self._decide()
        self._steps += 1
        if best is not None and best != self._best:
            self._best, self._gap = best, self.probe_every
            self._next_probe = self._steps + self._gap
        if probe:
            self._gap = min(2 * self._gap, self.max_probe_every)
            self._next_probe = self._steps + self._gap
        self._last_run[nodes] = self._steps
        self.chosen[nodes] += 1
        return nodes

    def observe(self, nodes: int, rows: int, tokens: int, seconds: float | None, slowest: int | None = None) -> None:
        """A finished verify step run at size ``nodes`` (as :meth:`choose` gave it, even when the
        step was cut short to fewer drafted nodes): ``rows`` requests committed ``tokens`` in
        ``seconds``, the time from the previous decode step's completion to this one's (None
        when that is not a clean per-step sample, e.g. a prefill ran in between). ``slowest``:
        the fewest tokens one of those requests committed, the step's score (None: the mean,
        ``tokens / rows``).

        Where steps overlap, the completions must be read on the device: the host learns of a
        step's completion only when it waits for it, which for an overlapped step is after it
        has launched the next one, so host times move the launch cost of a step onto the one
        before it."""
        if rows == 0:
            return
        before = self.rate(nodes)
        self._tokens[nodes].add(tokens / rows if slowest is None else slowest)
        if seconds is not None:
            self._seconds[nodes].add(seconds / rows)
        after = self.rate(nodes)
        if nodes != self._best and before is not None and after is not None and after > 1.1 * before:
            self._gap = self.probe_every
            self._next_probe = min(self._next_probe, self._steps + self._gap)

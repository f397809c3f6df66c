"""How many draft nodes a verify step runs: D always, or (``auto``) the size measured fastest.

A verify step over n nodes per request costs more than a plain decode step, and pays off only
when enough drafts are accepted; which n wins depends on the batch (B*n rows go through the
model), the device and the text. The ``auto`` policy measures while serving: for each tree size
of 1, 2, 4, ... up to D it keeps moving averages of the tokens committed per request per step
and of the wall time per request per step (time between the completions of consecutive decode
steps, so host overheads count too), and runs the size with the highest estimated tokens per
second. Every ``probe_every`` steps it runs the size it has measured least recently instead, so
the choice follows the workload (a copy-heavy stretch starts, a batch grows). Greedy output is
unaffected: every step is exact whatever size it uses.
"""

from __future__ import annotations


class _Average:
    """An exponential moving average that is None until its first sample."""

    def __init__(self, decay: float):
        self.decay = decay
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample


def tree_sizes(num_nodes: int) -> list[int]:
    """The sizes ``auto`` chooses among: 1, the powers of two below ``num_nodes``, and ``num_nodes``."""
    return sorted({1, num_nodes} | {1 << i for i in range(1, num_nodes.bit_length()) if 1 << i < num_nodes})


class SpecPolicy:
    """Picks the draft-tree size of each verify step.

    Args:
        num_nodes: D, the largest speculative tree.
        mode: ``"always"`` (every step uses D) or ``"auto"`` (the size in :func:`tree_sizes`
            measured fastest).
        probe_every: in ``auto``, steps between two probes of the size measured least recently.
        decay: weight of the past in the moving averages.
    """

    def __init__(self, num_nodes: int, mode: str = "always", probe_every: int = 16, decay: float = 0.7):
        if mode not in ("always", "auto"):
            raise ValueError(f"mode: expected 'always' or 'auto', got {mode!r}")
        self.num_nodes = num_nodes
        self.mode = mode
        self.probe_every = probe_every
        self.sizes = tree_sizes(num_nodes) if mode == "auto" else [num_nodes]
        self._tokens = {n: _Average(decay) for n in self.sizes}
        self._seconds = {n: _Average(decay) for n in self.sizes}
        self._last_run = {n: 0 for n in self.sizes}
        self._steps = 0
        self.chosen = {n: 0 for n in self.sizes}

    def rate(self, nodes: int) -> float | None:
        """Estimated tokens per request-second with ``nodes``, or None before it has been measured."""
        tokens, seconds = self._tokens[nodes].value, self._seconds[nodes].value
        if tokens is None or seconds is None or seconds <= 0:
            return None
        return tokens / seconds

    def choose(self) -> int:
        """The draft-tree size of the next verify step."""
        self._steps += 1
        unmeasured = [n for n in self.sizes if self.rate(n) is None]
        if len(self.sizes) == 1:
            nodes = self.sizes[0]
        elif unmeasured:
            nodes = max(unmeasured)
        elif self._steps % self.probe_every == 0:
            best = max(self.sizes, key=self.rate)
            nodes = min((n for n in self.sizes if n != best), key=self._last_run.__getitem__)
        else:
            nodes = max(self.sizes, key=self.rate)
        self._last_run[nodes] = self._steps
        self.chosen[nodes] += 1
        return nodes

    def observe(self, nodes: int, rows: int, tokens: int, seconds: float | None) -> None:
        """A finished verify step run at size ``nodes`` (as :meth:`choose` gave it, even when the
        step was cut short to fewer drafted nodes): ``rows`` requests committed ``tokens`` in
        ``seconds`` of wall time (None when the time is not a clean per-step sample, e.g. a
        prefill ran in between)."""
        if rows == 0:
            return
        self._tokens[nodes].add(tokens / rows)
        if seconds is not None:
            self._seconds[nodes].add(seconds / rows)

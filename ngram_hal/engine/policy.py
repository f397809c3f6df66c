"""When speculation would lose, turn it down: the per-step choice between D draft nodes and 1.

A verify step over D nodes per request costs more than a plain decode step (on a compute-bound
device, about D times the tokens), and pays off only when enough drafts are accepted. The
``auto`` policy measures both sides while serving: for each mode it keeps moving averages of the
tokens committed per request per step and of the wall time per request per step (time between
the completions of consecutive decode steps, so host overheads count too), and runs the mode
with the higher estimated tokens per second. The other mode is re-measured every
``probe_every`` steps, so the choice follows the workload (a copy-heavy stretch starts, a batch
grows). Greedy output is unaffected: every step is exact whichever D it uses.
"""

from __future__ import annotations


class _Average:
    """An exponential moving average that is None until its first sample."""

    def __init__(self, decay: float):
        self.decay = decay
        self.value: float | None = None

    def add(self, sample: float) -> None:
        self.value = sample if self.value is None else self.decay * self.value + (1 - self.decay) * sample


class SpecPolicy:
    """Picks the draft-tree size of each verify step.

    Args:
        num_nodes: D, the speculative tree size.
        mode: ``"always"`` (every step uses D) or ``"auto"`` (D or 1, whichever is measured faster).
        probe_every: in ``auto``, steps after which the mode not in use is tried once again.
        decay: weight of the past in the moving averages.
    """

    def __init__(self, num_nodes: int, mode: str = "always", probe_every: int = 16, decay: float = 0.7):
        if mode not in ("always", "auto"):
            raise ValueError(f"mode: expected 'always' or 'auto', got {mode!r}")
        self.num_nodes = num_nodes
        self.mode = mode
        self.probe_every = probe_every
        self._tokens = {n: _Average(decay) for n in (1, num_nodes)}
        self._seconds = {n: _Average(decay) for n in (1, num_nodes)}
        self._since = {n: 0 for n in (1, num_nodes)}
        self.chosen = {n: 0 for n in (1, num_nodes)}

    def rate(self, nodes: int) -> float | None:
        """Estimated tokens per request-second with ``nodes``, or None before it has been measured."""
        tokens, seconds = self._tokens[nodes].value, self._seconds[nodes].value
        if tokens is None or seconds is None or seconds <= 0:
            return None
        return tokens / seconds

    def choose(self) -> int:
        """The draft-tree size of the next verify step."""
        D = self.num_nodes
        if self.mode == "always" or D == 1:
            nodes = D
        else:
            spec, plain = self.rate(D), self.rate(1)
            if spec is None:
                nodes = D
            elif plain is None:
                nodes = 1
            else:
                nodes = D if spec >= plain else 1
                other = 1 if nodes == D else D
                if self._since[other] >= self.probe_every:
                    nodes = other
        for n in self._since:
            self._since[n] = 0 if n == nodes else self._since[n] + 1
        self.chosen[nodes] += 1
        return nodes

    def observe(self, nodes: int, rows: int, tokens: int, seconds: float | None) -> None:
        """A finished verify step: ``rows`` requests committed ``tokens`` in ``seconds`` of wall time
        (None when the time is not a clean per-step sample, e.g. a prefill ran in between). A
        speculative step cut short to fewer than D nodes counts as a step of the D mode."""
        if rows == 0:
            return
        nodes = 1 if nodes == 1 else self.num_nodes
        self._tokens[nodes].add(tokens / rows)
        if seconds is not None:
            self._seconds[nodes].add(seconds / rows)

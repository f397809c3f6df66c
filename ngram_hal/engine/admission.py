"""When to admit waiting requests: at once, or a few steps later, together in one prefill.

A prefill step stalls every running request for its whole length, and much of that length does not
grow with the requests it takes: on a device its launches and its read of every weight are paid
once per step. Admitting each request the moment a seat frees makes one prefill step per request;
waiting for more seats leaves the free ones idle meanwhile. :class:`AdmissionGate` weighs the two as
a ski rental: while requests wait for seats to gather, it adds up the idle seats' share of each
decode step's time, and admits once that reaches :data:`PATIENCE` times the fixed part of a prefill
step, the part a second request in the same step does not pay again. Waiting therefore never costs
more than half the prefill step it may save, and costs nothing where a prefill step has no fixed
part (its time grows with its tokens alone). The fixed part is measured, not assumed (:class:`PrefillCosts`); until it
is known, and until a decode step has been timed, every admission happens at once.

The gate admits at once also when nothing runs (no step to stall), when every waiting request fits
the free seats, and when the free seats fill the largest prefill one step takes.
"""

from __future__ import annotations

from collections import deque

WINDOW = 64
"""Recent prefill steps that :class:`PrefillCosts` fits its line through."""
PATIENCE = 0.5
"""The idle time requests wait for, as a share of a prefill step's fixed part. The ski rental's
break-even (1) waits as long as the saving is worth; waiting less loses less where the requests
that wait are a run's last ones (whose delay lengthens the run, not only their seats' idle time).
Replayed over a batch-16 run of the benchmark workload on an H100 (``bench/bench_admission_replay.py``),
half kept nearly all of the speculative runs' gain (1.07-1.08x against 1.08-1.09x at 1) and cost
plain decoding 0.3 % (1.3 % at 1)."""
DECAY = 0.1
"""Weight of each new decode step in :attr:`AdmissionGate.decode_s`, a moving average."""


class PrefillCosts:
    """The seconds of a prefill step as a line in its prompt tokens, fitted by least squares
    through the last :data:`WINDOW` steps; :attr:`fixed_s` is its intercept."""

    def __init__(self):
        self._seen: deque[tuple[int, float]] = deque(maxlen=WINDOW)

    def observe(self, tokens: int, seconds: float) -> None:
        """A prefill step of ``tokens`` prompt tokens (``tokens >= 1``) took ``seconds``."""
        if tokens < 1 or seconds < 0:
            raise ValueError(f"a prefill step of {tokens} tokens in {seconds} s: expected tokens >= 1, seconds >= 0")
        self._seen.append((tokens, seconds))

    def __len__(self) -> int:
        """Prefill steps in the window."""
        return len(self._seen)

    @property
    def fixed_s(self) -> float:
        """The seconds a prefill step costs whatever its tokens: the fitted line's intercept,
        between 0 and the shortest step seen; 0 until steps of two different sizes were seen."""
        n = len(self._seen)
        xs = [t for t, _ in self._seen]
        if n < 2 or min(xs) == max(xs):
            return 0.0
        ys = [s for _, s in self._seen]
        mx, my = sum(xs) / n, sum(ys) / n
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        return min(max(0.0, my - slope * mx), min(ys))


class AdmissionGate:
    """Decides, turn by turn, whether waiting requests are admitted now (module docstring).

    Args:
        max_running: seats of the batch.
        most: the most requests one prefill step takes (the captured prefills' batch), or None
            for no bound.
        costs: the prefill steps measured (the engine feeds it those comparable with the ones
            the gate decides about); kept for the engine's life (they are the device's).
        patience: the idle time waited for, as a share of a prefill step's fixed part.

    Attributes:
        decode_s: a decode step's seconds, a moving average of the steps :meth:`observe_decode` saw.
        idle_s: the decode time left idle, weighted by the idle seats' share, since the last admission.
    """

    def __init__(self, max_running: int, most: int | None, costs: PrefillCosts | None = None,
                 patience: float = PATIENCE):
        self.max_running, self.most, self.patience = max_running, most, patience
        self.costs = costs if costs is not None else PrefillCosts()
        self.decode_s = 0.0
        self.idle_s = 0.0

    def ready(self, waiting: int, free: int, running: int) -> bool:
        """Whether to admit now, with ``waiting`` requests queued, ``free`` seats and ``running``
        requests in the batch. When not, the decode step launched instead counts as waited for:
        its free seats' share of :attr:`decode_s` is added to :attr:`idle_s`."""
        seats = min(waiting, free)
        if seats == 0:
            return False
        whole = min(waiting, self.most or waiting)
        if running == 0 or seats >= whole or self.decode_s == 0.0 or self.idle_s >= self.patience * self.costs.fixed_s:
            self.idle_s = 0.0
            return True
        self.idle_s += self.decode_s * seats / self.max_running
        return False

    def observe_decode(self, seconds: float) -> None:
        """A decode step took ``seconds``."""
        self.decode_s = seconds if self.decode_s == 0.0 else (1 - DECAY) * self.decode_s + DECAY * seconds

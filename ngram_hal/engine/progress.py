"""What a command is doing, on stderr: rich spinners and bars on a terminal, plain lines elsewhere.

:class:`Status` picks the form once. When stdout and stderr are both terminals, a step shows a
spinner while it runs and each run a progress bar. Otherwise (a pipe, ``| tee``, a log file)
every status line is plain text with the seconds since the command started, ``[12.3s] loading
...``, and the runs' token counts come as a line every :data:`EVERY_S` seconds
(:class:`PlainProgress`). Every status line is wrapped to :data:`WIDTH` columns.
"""

from __future__ import annotations

import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

WIDTH = 80
"""The most columns a status line takes."""
EVERY_S = 5.0
"""Seconds between two token-count lines in plain form."""
STAMP_WIDTH = len("[1234.5s] ")
"""Columns a plain line's time stamp takes at most (in the first 10 000 s)."""


class TokenProgress(Protocol):
    """Where a run reports its tokens (``rich.progress.Progress`` is one, :class:`PlainProgress` another).

    ``add_task`` starts a count labelled ``description`` out of ``total`` tokens and returns its
    id; ``advance`` adds tokens to it; ``update`` changes its total (a request that stopped early
    takes its unused budget off).
    """

    def add_task(self, description: str, total: float | None = ...) -> Any: ...

    def advance(self, task_id: Any, advance: float = 1) -> None: ...

    def update(self, task_id: Any, *, total: float | None = None) -> None: ...


class Status:
    """Status lines, steps and progress of one command, on stderr.

    Args:
        plain: plain timestamped lines (True) or rich spinners and bars (False); None (default):
            rich only when stdout and stderr are both terminals.
        console: the rich console of the rich form (default: one on stderr).
        clock: seconds, monotonic (the time stamps and the interval of token-count lines).
        every_s: seconds between two token-count lines in plain form.
    """

    def __init__(self, plain: bool | None = None, console: Console | None = None,
                 clock: Callable[[], float] = time.monotonic, every_s: float = EVERY_S):
        self.plain = not (sys.stdout.isatty() and sys.stderr.isatty()) if plain is None else plain
        self.console = console or Console(stderr=True, soft_wrap=True)
        self.clock = clock
        self.every_s = every_s
        self.start = clock()

    def print(self, text: str) -> None:
        """One status line, time-stamped in plain form, wrapped to :data:`WIDTH` columns at spaces
        (a word too long for a line of its own, such as a long path, stays where it begins)."""
        stamp = f"[{self.clock() - self.start:.1f}s] " if self.plain else ""
        room = WIDTH - len(stamp)
        lines: list[str] = []
        for line in textwrap.wrap(text, room, subsequent_indent="  ", break_long_words=False,
                                  break_on_hyphens=False) or [""]:
            if lines and len(line) > room:
                lines[-1] += " " + line.lstrip()
            else:
                lines.append(line)
        if not self.plain:
            for line in lines:
                self.console.print(line, highlight=False, markup=False)
            return
        indent = " " * len(stamp)
        sys.stderr.write("".join((stamp if i == 0 else indent) + line + "\n" for i, line in enumerate(lines)))
        sys.stderr.flush()

    @contextmanager
    def status(self, text: str) -> Iterator[None]:
        """A step that takes a while: a spinner showing ``text`` while it runs (plain: ``text`` as
        the line of its start)."""
        if self.plain:
            self.print(text)
            yield
            return
        with self.console.status(text):
            yield

    def progress(self) -> AbstractContextManager[TokenProgress]:
        """Token counts of the runs inside the block: a bar per run, or :class:`PlainProgress`."""
        if self.plain:
            return PlainProgress(self)
        return Progress(TextColumn("{task.description:<11}"), BarColumn(bar_width=24), MofNCompleteColumn(),
                        TextColumn("tokens"), TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                        console=self.console)


@dataclass
class _Count:
    label: str
    total: int
    done: int = 0
    reported_done: bool = False

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    def text(self, unit: str) -> str:
        return f"{self.label} {self.done}/{self.total}{unit}" + (" (done)" if self.finished else "")


class PlainProgress:
    """Token counts of runs as plain status lines, ``generating: speculative 412/1520 tokens,
    plain 0/1520``: at the first tokens after a run was added, every ``status.every_s`` seconds,
    and when a run finishes (marked ``(done)``; it is left out of later lines). A line that
    would pass :data:`WIDTH` columns becomes one line per run."""

    def __init__(self, status: Status):
        self.status = status
        self.counts: list[_Count] = []
        self._last_s: float | None = None
        self._added = False

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc_info) -> None:
        return None

    def add_task(self, description: str, total: float | None = None) -> int:
        self.counts.append(_Count(description, int(total or 0)))
        self._added = True
        return len(self.counts) - 1

    def advance(self, task_id: int, advance: float = 1) -> None:
        self.counts[task_id].done += int(advance)
        self._tick()

    def update(self, task_id: int, *, total: float | None = None) -> None:
        if total is not None:
            self.counts[task_id].total = int(total)
        self._tick()

    def _tick(self) -> None:
        now = self.status.clock()
        shown = [c for c in self.counts if not c.reported_done]
        due = self._last_s is None or now - self._last_s >= self.status.every_s
        if not (due or self._added or any(c.finished for c in shown)):
            return
        self._last_s, self._added = now, False
        for c in shown:
            c.reported_done = c.finished
        line = "generating: " + ", ".join(c.text(" tokens" if i == 0 else "") for i, c in enumerate(shown))
        if len(line) <= WIDTH - STAMP_WIDTH:
            self.status.print(line)
            return
        for c in shown:
            self.status.print(f"generating: {c.text(' tokens')}")

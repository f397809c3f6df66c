"""What an engine counts over its life: steps, tokens, host and device seconds."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass
class EngineStats:
    """Counters of one engine's life. Times are host seconds.

    ``launch_s``: enqueuing steps (on the CPU this includes the compute itself).
    ``wait_s``: blocked on a step's event. ``process_s``: host work on a step's results done
    after the next step was enqueued (hidden behind the device on accelerators).
    ``critical_s``: host work on results done before the next step could be enqueued.
    ``tree_nodes``: draft-tree nodes run per request, summed over decode steps.
    ``device_busy_s`` / ``device_idle_s``: device seconds from each step's first queued op to its
    results copy, and from one step's end to the next one's start, read from timing events (left
    at 0 where the runtime has none, e.g. on the CPU). ``draft_s``: host time in the drafter
    (drafting trees, recording prompts and committed tokens); drafting is part of ``launch_s``,
    recording part of ``process_s`` or ``critical_s``, or neither for prompts (recorded while the
    device runs their prefill). ``critical_decodes``: verify steps whose results the host took
    before it could enqueue the next step (in the overlapped loop, those a host drafter needed,
    and the last). ``shadow_drafts`` / ``shadow_hits``: first drafts that plain steps scored
    without running them (drafted on the device anyway, or by a host drafter from the tokens
    before the step's; a request it matched nothing for has none), and how many matched the
    committed token. ``prefill_s``: the prefill steps' own seconds, from each one's first queued op
    to its results copy on the device, or its launch's host time (the compute itself) where the
    runtime is the host's.
    """

    prefill_steps: int = 0
    decode_steps: int = 0
    tree_nodes: int = 0
    decode_tokens: int = 0
    decode_rows: int = 0
    launch_s: float = 0.0
    wait_s: float = 0.0
    process_s: float = 0.0
    critical_s: float = 0.0
    device_busy_s: float = 0.0
    device_idle_s: float = 0.0
    draft_s: float = 0.0
    prefill_s: float = 0.0
    critical_decodes: int = 0
    shadow_drafts: int = 0
    shadow_hits: int = 0

    def reset(self) -> None:
        """Every counter back to zero."""
        for f in fields(self):
            setattr(self, f.name, f.default)

    @property
    def device_idle_fraction(self) -> float:
        """Idle device time between steps over busy plus idle (0 when not measured)."""
        total = self.device_busy_s + self.device_idle_s
        return self.device_idle_s / total if total else 0.0

    @property
    def tokens_per_step(self) -> float:
        """Mean tokens committed per request per verify step."""
        return self.decode_tokens / self.decode_rows if self.decode_rows else 0.0

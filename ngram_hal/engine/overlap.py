"""Host<->device traffic of the overlap loop, through the backend's runtime only.

Uploads go through (pinned, where the device has it) host buffers with ``non_blocking=True``, so
enqueuing a step never waits for the device. A launched step copies its results into host
buffers and records an event; :meth:`InflightStep.wait` is the one place the host blocks, and it
is called only once the next step has been enqueued (or when there is no next step).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..runtime import Runtime
from .policy import Acceptance
from .request import Request


class Transfer:
    """Asynchronous uploads and downloads for one device."""

    def __init__(self, runtime: Runtime):
        self.runtime = runtime
        self.device = runtime.device

    def upload(self, values: Sequence | torch.Tensor, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A device copy of host ``values``; never waits for queued device work."""
        host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
        if self.runtime.is_host:
            return host.contiguous()
        staged = self.runtime.empty_host(host.shape, host.dtype)
        staged.copy_(host)
        return staged.to(self.device, non_blocking=True)

    def download(self, t: torch.Tensor) -> torch.Tensor:
        """A host buffer that will hold ``t`` once the step's event has completed."""
        return self.runtime.to_host(t)


@dataclass(eq=False)
class InflightStep:
    """A launched step: its requests in batch order and where its results will land on the host.

    Attributes:
        kind: ``"prefill"`` (one token per request at ``b*D``) or ``"decode"`` (a verify step).
        reqs: the batch, in relay order.
        stride: D, the stride of ``tokens`` and ``logprobs``: the tree size of the step's relay.
        tokens: host int64[B*D] committed tokens, -1 padded. lens: host int64[B] tokens committed.
        logprobs: host float32[B*D] or None.
        event: recorded after the copies; complete once the host buffers are valid.
        begin: recorded before the step's first device op (with ``event``, times the step).
        launch_s: host seconds spent enqueuing the step.
        tree_size: the tree size a decode step ran.
        bucket: the batch bucket a decode step's cost is kept under.
        offered: per request, the drafts a decode step offered it (None for a prefill).
        context: a decode step's mean keys per request before its trees, as the policy read it.
        shadow: host bool[B] or None: for a plain step, whether each request's first draft (drafted
            on the device, not run) equals the token the step committed.
        records: per request, the :class:`Acceptance` the policy scored a
            decode step by, which its accepted drafts are added to (empty outside ``auto``).
        last_of_run: the engine paused after launching it (:meth:`Engine.pause
            <ngram_hal.engine.engine.Engine.pause>`), so the next step's device time is not
            measured from this one's end.
    """

    kind: str
    reqs: list[Request]
    stride: int
    tokens: torch.Tensor
    lens: torch.Tensor
    logprobs: torch.Tensor | None
    event: object
    begin: object = None
    shadow: torch.Tensor | None = None
    launch_s: float = 0.0
    tree_size: int = 1
    bucket: int = 1
    offered: list[int] | None = None
    context: float = 0.0
    records: list[Acceptance] = field(default_factory=list)
    absorbed: bool = False
    wait_s: float = field(default=0.0)
    last_of_run: bool = False

    def wait(self) -> None:
        """Block until the step's results are on the host; the time blocked goes to ``wait_s``."""
        start = time.perf_counter()
        self.event.synchronize()
        self.wait_s = time.perf_counter() - start

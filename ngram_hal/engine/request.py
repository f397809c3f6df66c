"""Requests: sampling parameters, per-request state, and the outputs the engine reports."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator

from .detokenizer import IncrementalDetokenizer


SEED_LIMIT = 2**64
"""Seeds are ints in ``[0, SEED_LIMIT)``, the 64 bits a request's random numbers are drawn from."""
Seed = Annotated[int, Field(ge=0, lt=SEED_LIMIT)]
"""A request's seed; a value outside ``[0, 2**64)`` is refused, not folded onto another seed."""

GREEDY_BELOW = 1e-5
"""Temperatures below this are greedy: the distribution is one-hot for all practical purposes,
and dividing logits by a temperature near float32's smallest would overflow to inf."""


class SamplingParams(BaseModel):
    """How one request is decoded.

    ``temperature`` below :data:`GREEDY_BELOW` (0 included) is greedy. ``top_k == 0`` and
    ``top_p == 1`` switch those filters off.
    ``seed`` makes a sampled request reproducible: the random number behind the token at each
    position depends only on the seed and that position, so the same seed commits the same
    tokens whatever the drafts, tree sizes or batch (up to the model's float rounding); it is an
    int in ``[0, 2**64)``. Every field is checked when the params are made, so an engine is never
    given a value it cannot use. Generation
    stops at the first of: ``max_new_tokens`` committed tokens, a token in ``stop_token_ids``
    (or the model's end-of-sequence token unless ``ignore_eos``), or a string of ``stop`` in the
    decoded text (the text is cut before it). With ``logprobs`` every committed token carries
    its log-probability under the model (the raw distribution, before temperature and filters).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    temperature: float = Field(0.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int = Field(0, ge=0)
    seed: Seed | None = None
    max_new_tokens: int = Field(128, ge=1)
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[Annotated[int, Field(ge=0)], ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in value):
            raise ValueError("stop strings must be non-empty")
        return value

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What the engine reports about one request after a step.

    ``new_token_ids`` / ``new_text`` / ``new_logprobs`` are the increment since the previous
    output of this request; ``token_ids`` / ``text`` / ``logprobs`` are everything so far.
    While a request runs, the last ``len(longest stop string) - 1`` characters are held back
    from ``new_text`` (they may turn out to start a stop string), so the ``new_text`` pieces
    always add up to the final ``text``. ``finish_reason`` is ``"stop"`` (a stop token or string),
    ``"length"`` (``max_new_tokens`` or the context), ``"abort"`` or ``"error"`` (see ``error``).
    ``verify_steps`` counts the decode (verify) steps the request took part in; the first token
    comes from the prefill. A plain record, not a validated model: the engine makes one from its
    own state at every step for every running request, on the host's critical path.
    """

    rid: str
    prompt_len: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[float] | None
    token_ids: list[int]
    text: str
    logprobs: list[float] | None
    finished: bool
    finish_reason: str | None
    error: str | None
    verify_steps: int


_ids = itertools.count()


@dataclass(eq=False)
class Request:
    """Engine-side state of one request (host only; the device state lives in the batch relay).

    ``seq_len`` is the number of tokens whose KV is in the cache as of the last processed step;
    ``inflight`` counts launched steps not yet processed, each of which may add up to D more.
    ``allocated`` slots cover positions ``0..allocated-1`` of row ``row``; ``slot_budget`` is
    the most slots the request may ever hold.
    """

    prompt_ids: list[int]
    params: SamplingParams
    rid: str = field(default_factory=lambda: f"req-{next(_ids)}")
    max_new_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    error: str | None = None
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    row: int = -1
    allocated: int = 0
    slot_budget: int = 0
    seq_len: int = 0
    inflight: int = 0
    verify_steps: int = 0
    stop_ids: frozenset[int] = frozenset()
    seed: int | None = None
    detok: IncrementalDetokenizer | None = None
    emitted_tokens: int = 0
    emitted_text: int = 0
    checked_tokens: int = 0
    reported: bool = False

    def __post_init__(self):
        self.max_new_tokens = self.params.max_new_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def text(self) -> str:
        return self.detok.text if self.detok is not None else ""

    def finish(self, reason: str, error: str | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        self.error = error

    def seq_bound(self, tree_size: int) -> int:
        """An upper bound on the request's device-side KV length (exact when nothing is in flight)."""
        return self.seq_len + self.inflight * tree_size

    def take_output(self) -> RequestOutput:
        """The increment since the last call, and everything so far."""
        new_ids = self.output_ids[self.emitted_tokens:]
        text = self.text
        hold = 0 if self.finished else max((len(s) for s in self.params.stop), default=1) - 1
        stable = max(self.emitted_text, len(text) - hold)
        new_text = text[self.emitted_text:stable]
        want_lp = self.params.logprobs
        new_lp = self.logprobs[self.emitted_tokens:] if want_lp else None
        self.emitted_tokens = len(self.output_ids)
        self.emitted_text = stable
        return RequestOutput(
            rid=self.rid, prompt_len=len(self.prompt_ids), new_token_ids=new_ids, new_text=new_text,
            new_logprobs=new_lp, token_ids=list(self.output_ids), text=text,
            logprobs=list(self.logprobs) if want_lp else None, finished=self.finished,
            finish_reason=self.finish_reason, error=self.error, verify_steps=self.verify_steps)

    def final_output(self) -> RequestOutput:
        """The last output of a finished request (:meth:`take_output`), marking it reported."""
        out = self.take_output()
        self.reported = True
        return out

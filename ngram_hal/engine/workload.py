"""Prompt files and measured runs of the engine over them (shared by ``ngram-hal run``/``bench``).

Runs compared with each other (speculative against plain decoding, say) take turns on the
machine: :func:`run_side_by_side` gives each engine a slice of about :data:`SLICE_S` seconds in
turn and times each one only inside its own slices. A change in how much of the CPU other
processes take then slows every run alike, instead of whichever happened to run at the time.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

from ..options import validation_message
from .engine import Engine
from .stats import EngineStats
from .progress import TokenProgress
from .request import RequestOutput, SamplingParams

SLICE_S = 0.25
"""Seconds of work an engine gets before the next one takes its turn."""

MAX_LINE_BYTES = 2**20
"""The most bytes one line of a prompts file may hold (1 MiB: far more than any context holds)."""
MAX_JSON_DEPTH = 8
"""The deepest nesting of brackets a prompts line may have (a prompt needs 3: line, messages, message)."""
MESSAGE_KEYS = ("role", "content")
"""The keys of one chat message, both required."""

_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_JSON_BRACKET = re.compile(r"[\[\]{}]")


class PromptSpec(BaseModel):
    """One line of a prompts file: chat turns (``{"role": ..., "content": ...}`` each) and an
    optional output budget. Any other key is refused, naming the keys allowed.

    ``line`` is the line of the file it was read from (None when it was not read from one).
    """

    model_config = ConfigDict(extra="forbid")

    id: str | None = None
    kind: str = "prompt"
    messages: list[dict[str, str]] = Field(min_length=1)
    max_new_tokens: int | None = Field(None, ge=1)
    _line: int | None = PrivateAttr(None)

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            unknown = [k for k in data if k not in cls.model_fields]
            if unknown:
                raise ValueError(f"{_keys('unknown', unknown)} (a line may hold: {', '.join(cls.model_fields)})")
            messages = data.get("messages")
            for i, message in enumerate(messages if isinstance(messages, list) else []):
                if not isinstance(message, dict):
                    continue
                unknown = [k for k in message if k not in MESSAGE_KEYS]
                missing = [k for k in MESSAGE_KEYS if k not in message]
                if unknown or missing:
                    what = _keys("unknown", unknown) if unknown else _keys("no", missing)
                    raise ValueError(f"messages[{i}]: {what} (a message has: {', '.join(MESSAGE_KEYS)})")
        return data

    @property
    def line(self) -> int | None:
        return self._line


def _keys(what: str, keys: list[str]) -> str:
    """``"unknown key 'a'"``, ``"unknown keys 'a', 'b'"``."""
    return f"{what} key{'s' if len(keys) > 1 else ''} {', '.join(repr(k) for k in keys)}"


def bundled_prompts() -> Path:
    """The prompts shipped with the package: copy-heavy ("copy") and open-ended ("open") ones."""
    return Path(str(resources.files("ngram_hal") / "data" / "prompts.jsonl"))


def json_depth_over(text: str, limit: int) -> bool:
    """Whether the JSON ``text`` nests brackets (``[`` and ``{``) more than ``limit`` deep, read
    without parsing it (brackets inside strings do not count)."""
    depth = 0
    for bracket in _JSON_BRACKET.finditer(_JSON_STRING.sub("", text)):
        depth += 1 if bracket.group() in "[{" else -1
        if depth > limit:
            return True
    return False


def _parse_line(raw: bytes, path: Path, n: int) -> PromptSpec | None:
    """Line ``n`` (bytes, newline included) of the prompts file ``path`` as a prompt, None when blank."""
    if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
        raise ValueError(f"{path} line {n}: longer than {MAX_LINE_BYTES} bytes (1 MiB), the most a line may hold")
    try:
        line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path} line {n}: not UTF-8 (byte 0x{raw[exc.start]:02x} at byte {exc.start + 1} of "
                         f"the line)") from None
    if not line.strip():
        return None
    if json_depth_over(line, MAX_JSON_DEPTH):
        raise ValueError(f"{path} line {n}: JSON nested deeper than {MAX_JSON_DEPTH} levels, the most a line "
                         f"may have (a prompt needs 3)")
    try:
        spec = PromptSpec.model_validate(json.loads(line))
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} line {n}: not JSON ({exc.msg} at column {exc.colno})") from None
    except ValidationError as exc:
        raise ValueError(f"{path} line {n}: {validation_message(exc)}") from None
    except ValueError as exc:  # what json refuses beyond its syntax, such as an int of 5000 digits
        raise ValueError(f"{path} line {n}: not usable JSON ({str(exc).split(';')[0]})") from None
    if spec.id is None:
        spec = spec.model_copy(update={"id": f"line-{n}"})
    spec._line = n
    return spec


def load_prompts(path: str | Path | None = None) -> list[PromptSpec]:
    """Read a JSONL prompts file (default :func:`bundled_prompts`); ids default to ``line-N``.

    Each line is checked before it is parsed (at most :data:`MAX_LINE_BYTES` bytes, UTF-8, brackets
    nested at most :data:`MAX_JSON_DEPTH` deep), then parsed as a :class:`PromptSpec`; ids must be
    distinct.

    Raises:
        OSError: the file cannot be read.
        ValueError: ``"<path> line <n>: <what is wrong>"`` for a line that is not a prompt
            (blank lines are skipped), or a message naming the file when it holds no prompt.
    """
    path = Path(path) if path is not None else bundled_prompts()
    specs: list[PromptSpec] = []
    seen: dict[str, int] = {}
    with open(path, "rb") as f:
        n = 0
        while raw := f.readline(MAX_LINE_BYTES + 2):  # a longest line and its "\r\n"
            n += 1
            spec = _parse_line(raw, path, n)
            if spec is None:
                continue
            if spec.id in seen:
                raise ValueError(f"{path} line {n}: id {spec.id!r} is already the id of line {seen[spec.id]}")
            seen[spec.id] = n
            specs.append(spec)
    if not specs:
        raise ValueError(f"{path}: no prompts (expected one JSON object a line with a 'messages' list)")
    return specs


def cap_new_tokens(specs: Sequence[PromptSpec], max_new_tokens: int) -> list[PromptSpec]:
    """``specs`` with every output budget at most ``max_new_tokens`` (a line without one gets it)."""
    return [s.model_copy(update={"max_new_tokens": min(s.max_new_tokens or max_new_tokens, max_new_tokens)})
            for s in specs]


class RequestRecord(BaseModel):
    """One request's result in a run."""

    id: str
    kind: str
    prompt_tokens: int
    text: str
    token_ids: list[int]
    verify_steps: int
    finish_reason: str | None
    error: str | None


COUNTS = ("requests", "output_tokens", "decode_tokens", "verify_steps", "wall_s", "decode_s", "prefill_steps",
          "decode_steps", "tree_nodes", "launch_s", "wait_s", "hidden_host_s", "critical_host_s", "draft_s",
          "device_busy_s", "device_idle_s", "prefill_s")
"""The fields of :class:`RunTotals` that add up over runs; the others are rates derived from them."""


def _rate(num: float, den: float) -> float:
    return num / den if den else 0.0


class RunTotals(BaseModel):
    """Totals of a run.

    ``decode_tokens`` are the tokens after each request's first (which the prefill samples): the
    tokens verify steps committed. ``tokens_per_verify_step`` is ``decode_tokens`` per request per
    verify step. ``wall_s`` is the time spent inside this run's engine (see
    :func:`run_side_by_side`) and ``tokens_per_s`` counts every output token over it, prefill
    included. ``decode_s`` is the part of ``wall_s`` after the last request of the run got its
    first token, and ``decode_tokens_per_s`` is ``decode_tokens`` over it. ``tree_nodes`` is the
    draft-tree nodes per request summed over decode steps. The device times (see
    :class:`~ngram_hal.engine.stats.EngineStats`; 0 on the CPU) cover the same decode window, so
    that neither the prefill nor a pause of the engine before the run counts. ``draft_s`` is the
    host time in the drafter (part of the launch and host times). ``prefill_s`` is the prefill
    steps' own seconds over the whole run (:class:`~ngram_hal.engine.stats.EngineStats`).
    """

    requests: int
    output_tokens: int
    decode_tokens: int
    verify_steps: int
    tokens_per_verify_step: float
    wall_s: float
    tokens_per_s: float
    decode_s: float
    decode_tokens_per_s: float
    prefill_steps: int
    decode_steps: int
    tree_nodes: int
    ms_per_decode_step: float
    launch_s: float
    wait_s: float
    hidden_host_s: float
    critical_host_s: float
    draft_s: float
    device_busy_s: float
    device_idle_s: float
    device_idle_fraction: float
    prefill_s: float

    @classmethod
    def from_counts(cls, **counts) -> "RunTotals":
        """The totals of the :data:`COUNTS` given, with the rates derived from them."""
        c = counts
        return cls(**c, tokens_per_verify_step=_rate(c["decode_tokens"], c["verify_steps"]),
                   tokens_per_s=_rate(c["output_tokens"], c["wall_s"]),
                   decode_tokens_per_s=_rate(c["decode_tokens"], c["decode_s"]),
                   ms_per_decode_step=_rate(1e3 * c["wall_s"], c["decode_steps"]),
                   device_idle_fraction=_rate(c["device_idle_s"], c["device_busy_s"] + c["device_idle_s"]))

    @classmethod
    def combine(cls, parts: Sequence["RunTotals"]) -> "RunTotals":
        """The totals of runs done one after another: counts and times added, rates over the sums."""
        return cls.from_counts(**{k: sum(getattr(p, k) for p in parts) for k in COUNTS})


class RunResult(BaseModel):
    """A run: the engine settings, every request, the totals."""

    config: dict
    requests: list[RequestRecord]
    totals: RunTotals


class _Run:
    """One engine working through the requests of a measured run, a slice at a time.

    Its clock (:meth:`clock`) runs only inside its own slices; it notes when each request got its
    first token, and the engine's counters when the last one did (the start of the decode window).
    """

    def __init__(self, label: str, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 progress: TokenProgress | None):
        self.engine = engine
        self.before = dataclasses.asdict(engine.stats)
        self.busy_s = 0.0
        self._slice_start = time.perf_counter()
        self.final: dict[str, RequestOutput] = {}
        self.rids = engine.add_requests(prompts, params)
        self.first_at: dict[str, float] = {}
        self.decode_from: tuple[float, dict] | None = None
        self.budget = dict(zip(self.rids, (p.max_new_tokens for p in params)))
        self.outputs: Iterator[RequestOutput] = engine.follow(self.rids)
        self.busy_s += time.perf_counter() - self._slice_start
        self.progress = progress
        self.total = sum(self.budget.values())
        self.task = None
        if progress is not None:
            self.task = progress.add_task(label, total=self.total)

    def clock(self) -> float:
        """Seconds of this run's own slices so far (inside a slice)."""
        return self.busy_s + time.perf_counter() - self._slice_start

    def work(self, seconds: float) -> bool:
        """Run for about ``seconds`` (whole steps, the device drained and the engine paused at the
        end); False once done."""
        start = self._slice_start = time.perf_counter()
        going = True
        while going and time.perf_counter() - start < seconds:
            out = next(self.outputs, None)
            going = out is not None
            if going:
                self._record(out)
        self.engine.backend.synchronize()
        self.engine.pause()
        self.busy_s += time.perf_counter() - start
        return going

    def _record(self, out: RequestOutput) -> None:
        if out.rid not in self.first_at and (out.token_ids or out.finished):
            self.first_at[out.rid] = self.clock()
            if len(self.first_at) == len(self.rids):
                self.decode_from = (self.first_at[out.rid], dataclasses.asdict(self.engine.stats))
        if out.finished:
            self.final[out.rid] = out
        if self.task is None:
            return
        self.progress.advance(self.task, len(out.new_token_ids))
        unused = self.budget[out.rid] - len(out.token_ids) if out.finished else 0
        if unused > 0:
            # A request that stopped early: the bar's total becomes what will really be generated.
            self.total -= unused
            self.progress.update(self.task, total=self.total)

    def result(self, specs: Sequence[PromptSpec]) -> RunResult:
        engine = self.engine
        now = dataclasses.asdict(engine.stats)
        stats = EngineStats(**{k: v - self.before[k] for k, v in now.items()})
        decode_start, at_decode = self.decode_from or (self.busy_s, now)
        window = EngineStats(**{k: v - at_decode[k] for k, v in now.items()})
        order = [self.final[rid] for rid in self.rids]
        records = [RequestRecord(id=s.id, kind=s.kind, prompt_tokens=o.prompt_len, text=o.text,
                                 token_ids=o.token_ids, verify_steps=o.verify_steps, finish_reason=o.finish_reason,
                                 error=o.error) for s, o in zip(specs, order)]
        totals = RunTotals.from_counts(
            requests=len(records), output_tokens=sum(len(r.token_ids) for r in records),
            decode_tokens=sum(max(len(r.token_ids) - 1, 0) for r in records),
            verify_steps=sum(r.verify_steps for r in records), wall_s=self.busy_s,
            decode_s=self.busy_s - decode_start, prefill_steps=stats.prefill_steps, decode_steps=stats.decode_steps,
            tree_nodes=stats.tree_nodes, launch_s=stats.launch_s, wait_s=stats.wait_s,
            hidden_host_s=stats.process_s, critical_host_s=stats.critical_s, draft_s=stats.draft_s,
            device_busy_s=window.device_busy_s,
            device_idle_s=window.device_idle_s, prefill_s=stats.prefill_s)
        return RunResult(config=engine.config.model_dump(), requests=records, totals=totals)


def run_side_by_side(engines: Sequence[tuple[str, Engine]], tokenizer, specs: Sequence[PromptSpec],
                     params: SamplingParams, progress: TokenProgress | None = None,
                     slice_s: float = SLICE_S) -> list[RunResult]:
    """Generate for ``specs`` on each ``(label, engine)``, the engines taking turns, and time each.

    A line's ``max_new_tokens`` overrides ``params``'. Each engine gets about ``slice_s``
    seconds of whole steps in turn, its device drained at the end of its slice; its time is
    the sum of its slices. With ``progress``, each engine has a bar labelled ``label`` whose
    total drops by the unused budget of every request that stops early, so it ends at 100 %.
    """
    prompts = [tokenizer.encode_chat(s.messages) for s in specs]
    per = [params.model_copy(update={"max_new_tokens": s.max_new_tokens}) if s.max_new_tokens else params
           for s in specs]
    runs = [_Run(label, engine, prompts, per, progress) for label, engine in engines]
    live = list(runs)
    while live:
        live = [run for run in live if run.work(slice_s)]
    return [run.result(specs) for run in runs]


def run_prompts(engine: Engine, tokenizer, specs: Sequence[PromptSpec], params: SamplingParams,
                progress: TokenProgress | None = None, label: str = "generating") -> RunResult:
    """One engine's run of :func:`run_side_by_side`."""
    return run_side_by_side([(label, engine)], tokenizer, specs, params, progress)[0]

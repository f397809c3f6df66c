"""Prompt files and measured runs of the engine over them (shared by ``ngram-hal run``/``bench``).

Runs compared with each other (speculative against plain decoding, say) take turns on the
machine: :func:`run_side_by_side` gives each engine a slice of about :data:`SLICE_S` seconds in
turn and times each one only inside its own slices. A change in how much of the CPU other
processes take then slows every run alike, instead of whichever happened to run at the time.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from rich.progress import Progress, TaskID

from ..options import validation_message
from .engine import Engine, EngineStats
from .request import RequestOutput, SamplingParams

SLICE_S = 0.25
"""Seconds of work an engine gets before the next one takes its turn."""


class PromptSpec(BaseModel):
    """One line of a prompts file: chat turns and an optional output budget."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    kind: str = "prompt"
    messages: list[dict[str, str]] = Field(min_length=1)
    max_new_tokens: int | None = Field(None, ge=1)


def bundled_prompts() -> Path:
    """The prompts shipped with the package: copy-heavy ("copy") and open-ended ("open") ones."""
    return Path(str(resources.files("ngram_hal") / "data" / "prompts.jsonl"))


def load_prompts(path: str | Path | None = None) -> list[PromptSpec]:
    """Read a JSONL prompts file (default :func:`bundled_prompts`); ids default to ``line-N``.

    Raises:
        OSError: the file cannot be read.
        ValueError: ``"<path> line <n>: <what is wrong>"`` for a line that is not a prompt
            (blank lines are skipped), or a message naming the file when it holds no prompt.
    """
    path = Path(path) if path is not None else bundled_prompts()
    specs = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                spec = PromptSpec.model_validate(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path} line {n}: not JSON ({exc.msg} at column {exc.colno})") from None
            except ValidationError as exc:
                raise ValueError(f"{path} line {n}: {validation_message(exc)}") from None
            specs.append(spec if spec.id else spec.model_copy(update={"id": f"line-{n}"}))
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


class RunTotals(BaseModel):
    """Totals of a run. ``tokens_per_verify_step`` counts tokens committed by verify steps (not
    the first token of each request, which the prefill samples) per request per step.
    ``wall_s`` is the time spent inside this run's engine (see :func:`run_side_by_side`)."""

    requests: int
    output_tokens: int
    verify_steps: int
    tokens_per_verify_step: float
    wall_s: float
    tokens_per_s: float
    prefill_steps: int
    decode_steps: int
    ms_per_decode_step: float
    launch_s: float
    wait_s: float
    hidden_host_s: float
    critical_host_s: float


class RunResult(BaseModel):
    """A run: the engine settings, every request, the totals."""

    config: dict
    requests: list[RequestRecord]
    totals: RunTotals


class _Run:
    """One engine working through the requests of a measured run, a slice at a time."""

    def __init__(self, label: str, engine: Engine, prompts: list[list[int]], params: list[SamplingParams],
                 progress: Progress | None):
        self.engine = engine
        self.before = dataclasses.asdict(engine.stats)
        self.busy_s = 0.0
        self.final: dict[str, RequestOutput] = {}
        start = time.perf_counter()
        self.rids = engine.add_requests(prompts, params)
        self.budget = dict(zip(self.rids, (p.max_new_tokens for p in params)))
        self.outputs: Iterator[RequestOutput] = engine.follow(self.rids)
        self.busy_s += time.perf_counter() - start
        self.progress = progress
        self.total = sum(self.budget.values())
        self.task: TaskID | None = None
        if progress is not None:
            self.task = progress.add_task(label, total=self.total)

    def work(self, seconds: float) -> bool:
        """Run for about ``seconds`` (whole steps, the device drained at the end); False once done."""
        start = time.perf_counter()
        going = True
        while going and time.perf_counter() - start < seconds:
            out = next(self.outputs, None)
            going = out is not None
            if going:
                self._record(out)
        self.engine.backend.synchronize()
        self.busy_s += time.perf_counter() - start
        return going

    def _record(self, out: RequestOutput) -> None:
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
        stats = EngineStats(**{k: v - self.before[k] for k, v in dataclasses.asdict(engine.stats).items()})
        order = [self.final[rid] for rid in self.rids]
        records = [RequestRecord(id=s.id, kind=s.kind, prompt_tokens=o.prompt_len, text=o.text,
                                 token_ids=o.token_ids, verify_steps=o.verify_steps, finish_reason=o.finish_reason,
                                 error=o.error) for s, o in zip(specs, order)]
        out_tokens = sum(len(r.token_ids) for r in records)
        steps = sum(r.verify_steps for r in records)
        verified = sum(max(len(r.token_ids) - 1, 0) for r in records)
        wall = self.busy_s
        totals = RunTotals(
            requests=len(records), output_tokens=out_tokens, verify_steps=steps,
            tokens_per_verify_step=verified / steps if steps else 0.0, wall_s=wall,
            tokens_per_s=out_tokens / wall if wall else 0.0, prefill_steps=stats.prefill_steps,
            decode_steps=stats.decode_steps,
            ms_per_decode_step=1e3 * wall / stats.decode_steps if stats.decode_steps else 0.0,
            launch_s=stats.launch_s, wait_s=stats.wait_s, hidden_host_s=stats.process_s,
            critical_host_s=stats.critical_s)
        return RunResult(config=engine.config.model_dump(), requests=records, totals=totals)


def run_side_by_side(engines: Sequence[tuple[str, Engine]], tokenizer, specs: Sequence[PromptSpec],
                     params: SamplingParams, progress: Progress | None = None,
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
                progress: Progress | None = None, label: str = "generating") -> RunResult:
    """One engine's run of :func:`run_side_by_side`."""
    return run_side_by_side([(label, engine)], tokenizer, specs, params, progress)[0]

"""Prompt files and measured runs of the engine over them (shared by ``ngram-hal run``/``bench``)."""

from __future__ import annotations

import dataclasses
import json
import time
from importlib import resources
from pathlib import Path

from pydantic import BaseModel, ConfigDict
from tqdm import tqdm

from .engine import Engine, EngineStats
from .request import SamplingParams


class PromptSpec(BaseModel):
    """One line of a prompts file: chat turns and an optional output budget."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    kind: str = "prompt"
    messages: list[dict[str, str]]
    max_new_tokens: int | None = None


def bundled_prompts() -> Path:
    """The prompts shipped with the package: copy-heavy ("copy") and open-ended ("open") ones."""
    return Path(str(resources.files("ngram_hal") / "data" / "prompts.jsonl"))


def load_prompts(path: str | Path | None = None) -> list[PromptSpec]:
    """Read a JSONL prompts file (default :func:`bundled_prompts`); ids default to ``line-N``."""
    path = Path(path) if path is not None else bundled_prompts()
    specs = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                spec = PromptSpec.model_validate(json.loads(line))
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a prompt line ({exc})") from exc
            specs.append(spec if spec.id else spec.model_copy(update={"id": f"line-{n}"}))
    return specs


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
    the first token of each request, which the prefill samples) per request per step."""

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


def run_prompts(engine: Engine, tokenizer, specs: list[PromptSpec], params: SamplingParams,
                progress: bool = True) -> RunResult:
    """Generate for ``specs`` on ``engine`` (a line's ``max_new_tokens`` overrides ``params``) and time it."""
    prompts = [tokenizer.encode_chat(s.messages) for s in specs]
    per = [params.model_copy(update={"max_new_tokens": s.max_new_tokens}) if s.max_new_tokens else params
           for s in specs]
    before = dataclasses.asdict(engine.stats)
    bar = tqdm(total=sum(p.max_new_tokens for p in per), unit="tok", disable=None if progress else True,
               leave=False, desc="generating")
    final = {}
    start = time.perf_counter()
    with bar:
        rids = [engine.add_request(p, sp) for p, sp in zip(prompts, per)]
        for out in engine.follow(rids):
            bar.update(len(out.new_token_ids))
            if out.finished:
                final[out.rid] = out
    wall = time.perf_counter() - start
    stats = EngineStats(**{k: v - before[k] for k, v in dataclasses.asdict(engine.stats).items()})
    order = [final[rid] for rid in rids]
    records = [RequestRecord(id=s.id, kind=s.kind, prompt_tokens=o.prompt_len, text=o.text, token_ids=o.token_ids,
                             verify_steps=o.verify_steps, finish_reason=o.finish_reason, error=o.error)
               for s, o in zip(specs, order)]
    out_tokens = sum(len(r.token_ids) for r in records)
    steps = sum(r.verify_steps for r in records)
    verified = sum(max(len(r.token_ids) - 1, 0) for r in records)
    totals = RunTotals(
        requests=len(records), output_tokens=out_tokens, verify_steps=steps,
        tokens_per_verify_step=verified / steps if steps else 0.0, wall_s=wall,
        tokens_per_s=out_tokens / wall if wall else 0.0, prefill_steps=stats.prefill_steps,
        decode_steps=stats.decode_steps,
        ms_per_decode_step=1e3 * wall / stats.decode_steps if stats.decode_steps else 0.0,
        launch_s=stats.launch_s, wait_s=stats.wait_s, hidden_host_s=stats.process_s,
        critical_host_s=stats.critical_s)
    return RunResult(config=engine.config.model_dump(), requests=records, totals=totals)

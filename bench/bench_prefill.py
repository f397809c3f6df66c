"""Prefill steps alone: the engine's own prefills of the first k copy-heavy prompts, with every
admission a captured prefill (the engine's rule) or without that bound, and on CUDA the kernels.

Each case runs the first k copy-heavy prompts of a prompts file (open-ended ones are a few dozen
tokens) through one engine with one new token each, so that a run is its prefill steps and nothing
else. ``cap`` is the engine's rule: one admission takes at most what a captured prefill holds
(``Scheduler.prefill_cap``), so k prompts of many tokens take several captured prefills; an
engine that captures no steps has no bound, and only ``none`` runs. ``none`` takes the bound off:
the k prompts come in one prefill, eager where they pass what a captured one holds. After
``--warmup`` runs, ``--reps`` runs are timed by the engine's ``EngineStats.prefill_s`` (each
prefill step's device seconds from its first queued op to its results copy; on the CPU its
launch's host time, the compute itself). On CUDA ``--profile`` more runs of the ``cap`` rows go
under ``torch.profiler`` for the kernels with the most device time (kernels launched early overlap
the one before them, so their times rank them but do not add up to a step).

    python bench/bench_prefill.py --device cuda [--requests 1,2,4] [--json reports/bench_prefill.json]
    python bench/bench_prefill.py --device cpu --requests 1 --reps 1 --warmup 0   # the reference, no graphs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_console, make_table, report_header, write_report  # noqa: E402
from step_profile import count_events  # noqa: E402

from ngram_hal.backend import OPS  # noqa: E402
from ngram_hal.cli.engine_args import DTYPES  # noqa: E402
from ngram_hal.cli.setup import default_drafter, default_tree_size  # noqa: E402
from ngram_hal.options import int_list  # noqa: E402
from ngram_hal.engine.engine import Engine, EngineConfig  # noqa: E402
from ngram_hal.engine.gguf_loader import find_model_file  # noqa: E402
from ngram_hal.engine.model import LlamaModel  # noqa: E402
from ngram_hal.engine.request import SamplingParams  # noqa: E402
from ngram_hal.engine.tokenizer import Tokenizer  # noqa: E402
from ngram_hal.engine.workload import load_prompts  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402

SCHEMA = "ngram-hal-bench-prefill/1"
ONE = SamplingParams(max_new_tokens=1, ignore_eos=True)
"""What each prompt of a run asks for: its prefill's token and nothing after it."""
BOUNDS = ("cap", "none")
"""``cap``: the engine's bound on one admission; ``none``: the k prompts in one prefill (the only
row where the engine has no bound: no captured steps)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="torch device (default cpu)")
    ap.add_argument("--backend", default="auto", help="backend name (default: the device's own)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="auto")
    ap.add_argument("--prompts", default="bench/data/workload-check.jsonl", help="prompts JSONL")
    ap.add_argument("--requests", type=int_list, default=[1, 2, 4], help="prompts a case takes (default 1,2,4)")
    ap.add_argument("--reps", type=int, default=20, help="timed runs a case (default 20)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed runs a case first (default 3)")
    ap.add_argument("--profile", type=int, default=5, help="profiled runs a cap case on CUDA (default 5; 0: none)")
    ap.add_argument("--json", default="reports/bench_prefill.json")
    args = ap.parse_args(argv)
    for name in ("reps", "warmup", "profile"):
        if getattr(args, name) < (1 if name == "reps" else 0):
            ap.error(f"argument --{name}: {getattr(args, name)} is too few")
    return args


def time_case(engine: Engine, prompts: list[list[int]], args) -> dict:
    """Prefill steps and seconds of ``prompts`` run together, one new token each."""
    for _ in range(args.warmup):
        engine.generate(prompts, ONE)
    engine.backend.synchronize()
    seconds, steps = engine.stats.prefill_s, engine.stats.prefill_steps
    for _ in range(args.reps):
        engine.generate(prompts, ONE)
    engine.backend.synchronize()
    seconds, steps = engine.stats.prefill_s - seconds, engine.stats.prefill_steps - steps
    return {"prefill_steps_per_run": steps / args.reps, "ms_per_run": 1e3 * seconds / args.reps,
            "ms_per_step": 1e3 * seconds / steps}


def profile_case(engine: Engine, prompts: list[list[int]], runs: int) -> dict:
    """:func:`step_profile.count_events` of ``runs`` runs of ``prompts``, per prefill step."""
    from torch.profiler import ProfilerActivity, profile

    steps = engine.stats.prefill_steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            engine.generate(prompts, ONE)
        engine.backend.synchronize()
    return count_events(prof.events(), engine.stats.prefill_steps - steps)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    backend = get_backend(args.backend, device=args.device, require=OPS)
    path = find_model_file()
    model = LlamaModel.from_gguf(backend, path, DTYPES[args.dtype])
    tok = Tokenizer(model.tokenizer_metadata)
    copy = [tok.encode_chat(s.messages) for s in load_prompts(args.prompts) if s.kind != "open"]
    if len(copy) < max(args.requests):
        raise SystemExit(f"--requests {max(args.requests)}: {args.prompts} has {len(copy)} copy-heavy prompts")
    engine = Engine(model, tok, EngineConfig(tree_size=default_tree_size(backend), drafter=default_drafter(backend),
                                             max_running=max(16, max(args.requests))))
    cap = engine.sched.prefill_cap
    profiling = args.profile > 0 and backend.device.type == "cuda"
    console = make_console()
    rows = []
    for k in args.requests:
        prompts = copy[:k]
        for bound in BOUNDS if cap is not None else BOUNDS[1:]:
            engine.sched.prefill_cap = cap if bound == "cap" else None
            row = {"requests": k, "tokens": sum(map(len, prompts)), "bound": bound, **time_case(engine, prompts, args)}
            if profiling and bound == "cap":
                row["profile"] = profile_case(engine, prompts, args.profile)
            rows.append(row)
    engine.sched.prefill_cap = cap
    table = make_table(f"prefill steps ({backend.name} on {backend.runtime.device_name}; cap: "
                       f"{'none, no graphs' if cap is None else f'{cap[0]} requests, {cap[1]} tokens'})",
                       ("requests", "tokens", "bound", "prefills / run", "ms / run", "ms / prefill"), ("bound",))
    for r in rows:
        table.add_row(str(r["requests"]), str(r["tokens"]), r["bound"], f"{r['prefill_steps_per_run']:.1f}",
                      f"{r['ms_per_run']:.2f}", f"{r['ms_per_step']:.2f}")
    console.print(table)
    for r in rows:
        for kernel in (r.get("profile") or {}).get("top_kernels", [])[:8]:
            console.print(f"{r['requests']} requests: {kernel['us_per_step']:8.1f} us x{kernel['per_step']:.0f} "
                          f"{kernel['name']}", markup=False, highlight=False)
    report = {**report_header(SCHEMA, backend), "model": path.name,
              "dtype": str(model.dtype).removeprefix("torch."), "graphs": engine.graphs is not None,
              "prefill_cap": cap, "prompts": args.prompts, "reps": args.reps, "warmup": args.warmup, "cases": rows}
    write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

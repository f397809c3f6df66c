"""Replay a batched run's requests through continuous batching, with and without gathered admission.

A prefill step stalls the whole batch, and the engine's admission gate
(:class:`ngram_hal.engine.admission.AdmissionGate`) lets requests wait for more free seats so that
one prefill step takes several. This replays a ``bench/bench_engine.py`` report's batched runs:
each request takes the verify steps it took there (the report's ``verify_steps``), requests are
admitted first come first served into ``batch`` seats, and every turn is a prefill step of the
requests admitted now or a decode step of the batch. The gate itself decides when to admit, fed
the same costs as in the engine; the step costs come from the report and one measured figure:

* ``--anchor RUN=MS``: one run's decode step, measured (e.g. the GPU time a profile gives);
* a prefill step's fixed part: the rest of that run's wall time over its prefill steps;
* every other run's decode step: the rest of its wall time, less its prefill steps, over its
  decode steps;
* ``--prefill-token-us``: a prefill's cost per prompt token on top (0 by default: the fixed part
  then holds it on average).

The table gives, per run and rule (no gate, then the gate at each ``--patience``), the prefill and
decode steps, the replayed seconds and their ratio to the replay without the gate. The replay
without the gate reproduces the report's step counts, which the table shows beside it.

    python bench/bench_admission_replay.py --outputs docs/bench/h100-active/engine-b16-after.json
        --anchor spec16-device=1.348 [--patience 0.25,0.5,1] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.engine.admission import PATIENCE, AdmissionGate, PrefillCosts  # noqa: E402
from ngram_hal.engine.graphs import PREFILL_BATCH  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402

SCHEMA = "ngram-hal-bench-admission-replay/1"
MAX_PREFILL_TOKENS = 4096
"""Prompt tokens one prefill step takes (``EngineConfig.max_prefill_tokens``' default)."""


def replay(steps: Sequence[int], prompt_tokens: Sequence[int], batch: int, step_s: float, prefill_s: float,
           token_s: float, patience: float | None) -> dict:
    """Requests of ``steps[i]`` verify steps and ``prompt_tokens[i]`` prompt tokens through
    ``batch`` seats; ``patience`` None admits as soon as seats free, else the gate decides with that
    patience. Returns the prefill and decode steps and the seconds."""
    costs = PrefillCosts()
    costs.observe(1, prefill_s + token_s)  # two sizes on the line: its intercept is the fixed part
    costs.observe(2, prefill_s + 2 * token_s)
    gate = None if patience is None else AdmissionGate(batch, PREFILL_BATCH, costs, patience=patience)
    waiting, left = list(range(len(steps))), {}
    seconds, prefills, decodes = 0.0, 0, 0
    while waiting or left:
        free = batch - len(left)
        if waiting and free and (gate is None or gate.ready(len(waiting), free, len(left))):
            taken, tokens = [], 0
            while waiting and len(taken) < free:
                n = prompt_tokens[waiting[0]]
                if taken and tokens + n > MAX_PREFILL_TOKENS:
                    break
                tokens += n
                taken.append(waiting.pop(0))
            left.update((i, steps[i]) for i in taken)
            seconds += prefill_s + token_s * tokens
            prefills += 1
            continue
        seconds += step_s
        decodes += 1
        if gate is not None:
            gate.observe_decode(step_s)
        left = {i: n - 1 for i, n in left.items() if n > 1}
    return {"prefill_steps": prefills, "decode_steps": decodes, "seconds": seconds}


def step_costs(runs: Sequence[dict], anchor: str, anchor_ms: float) -> tuple[float, dict[str, float]]:
    """``(prefill fixed seconds, {run: decode step seconds})`` from the runs' wall times and steps,
    given ``anchor``'s decode step (module docstring)."""
    by_name = {r["run"]: r["totals"] for r in runs}
    if anchor not in by_name:
        raise ValueError(f"--anchor {anchor}: no such run in the report (runs: {', '.join(by_name)})")
    a = by_name[anchor]
    if not a["prefill_steps"]:
        raise ValueError(f"--anchor {anchor}: the run has no prefill step to derive a prefill's cost from")
    prefill_s = (a["wall_s"] - a["decode_steps"] * anchor_ms / 1e3) / a["prefill_steps"]
    if prefill_s <= 0:
        raise ValueError(f"--anchor {anchor}={anchor_ms}: its decode steps alone exceed the run's wall time")
    return prefill_s, {name: (t["wall_s"] - t["prefill_steps"] * prefill_s) / t["decode_steps"]
                       for name, t in by_name.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=Path, required=True, help="a bench_engine report of one batch size above 1")
    parser.add_argument("--anchor", required=True, metavar="RUN=MS", help="one run's decode step, measured, in ms")
    parser.add_argument("--patience", default="0.25,0.5,1", help=f"gate patiences to replay (the engine's: {PATIENCE})")
    parser.add_argument("--prefill-token-us", type=float, default=0.0, help="a prefill's cost per prompt token")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.outputs.read_text())
        runs = [r for r in report["runs"] if r.get("status") == "ok" and r["batch"] > 1]
        if not runs:
            raise ValueError(f"--outputs {args.outputs}: no batched run to replay")
        name, _, ms = args.anchor.partition("=")
        prefill_s, step_s = step_costs(runs, name, float(ms))
        patiences = [float(p) for p in args.patience.split(",") if p]
        if any(p <= 0 for p in patiences):
            raise ValueError(f"--patience {args.patience}: every patience must be above 0")
    except (ValueError, KeyError) as exc:
        parser.error(str(exc))
    prompt_tokens = {p["id"]: p["prompt_tokens"] for p in report["prompts"]}
    token_s = args.prefill_token_us / 1e6
    rows = []
    for r in runs:
        tokens = [prompt_tokens[rid] for rid in r["requests"]]
        base = replay(r["verify_steps"], tokens, r["batch"], step_s[r["run"]], prefill_s, token_s, None)
        for patience in [None, *patiences]:
            got = base if patience is None else replay(r["verify_steps"], tokens, r["batch"], step_s[r["run"]],
                                                       prefill_s, token_s, patience)
            rows.append({"run": r["run"], "batch": r["batch"], "patience": patience, **got,
                         "vs_no_gate": base["seconds"] / got["seconds"],
                         "report_steps": [r["totals"]["prefill_steps"], r["totals"]["decode_steps"]]})
    console = make_console()
    table = make_table(f"admission replayed over {args.outputs.name}: prefill step {prefill_s * 1e3:.2f} ms "
                       f"+ {args.prefill_token_us:g} us a token", ["run", "B", "rule", "prefills", "decodes",
                       "seconds", "speed vs no gate", "report: prefills, decodes"], left=["run", "rule"])
    for row in rows:
        rule = "no gate" if row["patience"] is None else f"gate, patience {row['patience']:g}"
        table.add_row(row["run"], str(row["batch"]), rule, str(row["prefill_steps"]), str(row["decode_steps"]),
                      f"{row['seconds']:.3f}", f"{row['vs_no_gate']:.3f}x", ", ".join(map(str, row["report_steps"])))
    console.print(table)
    if args.json:
        out = {**report_header(SCHEMA, get_backend("cpu")), "outputs": str(args.outputs), "anchor": args.anchor,
               "prefill_fixed_s": prefill_s, "prefill_token_s": token_s, "decode_step_s": step_s, "rows": rows}
        write_report(args.json, out, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

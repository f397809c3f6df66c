"""Replay ``auto`` with drafts made on the device over a GPU run's greedy outputs, at its step costs.

``bench/bench_policy_replay.py`` replays the policy of a host drafter (which tells it each draft's
match length) request by request. With the device drafter the policy knows no match length: it
scores each request by its own record, every step pays for the size chosen whether or not a chain
matched, and in the overlapped loop a step's record reaches the policy after the next step was
chosen. This replays exactly that, over the greedy outputs of a ``bench/bench_engine.py`` report
(its plain run's token ids at batch 1, each request once; prompts from ``--prompts``) and the step
costs its ``auto*-device`` runs calibrated and measured (``step_costs``, by batch bucket and tree
size; ``--costs-report`` takes them from another report): at each batch size of
``--batch-sizes``, the requests in turn through that many seats, each step of one tree size for the
whole batch. Drafts come from prompt lookup on the host (:class:`LinearDrafter`, the device
drafter's algorithm); a draft is accepted while it equals the output's next token. For each fixed
size and ``auto`` (:class:`~ngram_hal.engine.policy.SpecPolicy` itself): the seconds of the step
costs summed, the speedup over plain steps, tokens per step and steps by size. What it leaves out
is what the engine adds on the device: prefills, and steps that cost otherwise than the costs say.

    python bench/bench_device_policy_replay.py --engine-report docs/bench/h200-overlap-check-b1.json \\
        [--costs-report docs/bench/h200-overlap-check-batched.json] [--batch-sizes 1,4] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_active_replay import load_outputs  # noqa: E402
from bench_policy_replay import accepted_run  # noqa: E402
from common import make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.options import int_list  # noqa: E402
from ngram_hal.engine.policy import SpecPolicy, StepCosts  # noqa: E402
from ngram_hal.engine.tokenizer import Tokenizer  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402
from ngram_hal.speculative.drafter import LinearDrafter  # noqa: E402

SCHEMA = "ngram-hal-bench-device-policy-replay/1"


def step_costs(report: dict) -> dict[int, dict[int, float]]:
    """{batch bucket: {tree size: seconds}} of a ``bench_engine`` report's ``auto*-device`` runs (a
    bucket from the first run that has it)."""
    costs: dict[int, dict[int, float]] = {}
    for run in report.get("runs", []):
        if run.get("policy") == "auto" and run.get("drafter") == "device" and run.get("step_costs"):
            for bucket, sizes in run["step_costs"].items():
                costs.setdefault(int(bucket), {int(n): s for n, s in sizes.items()})
    return costs


class Seat:
    """One request being replayed: prompt lookup over its prompt and the tokens it committed."""

    def __init__(self, index: int, prompt: list[int], out: list[int]):
        self.rid, self.seq_len, self.out, self.at = str(index), len(prompt) + 1, out, 1
        self.drafter = LinearDrafter()
        self.drafter.add_request(0, prompt + out[:1])

    def run(self, lookahead: int) -> int | None:
        """Drafts of the next chain the output would accept (up to ``lookahead``); None: no match."""
        (length,) = self.drafter.match_lengths([0])
        return accepted_run(self.drafter, self.out, self.at, lookahead) if length else None

    def commit(self, k: int) -> int:
        """Commit the output's next ``k`` tokens (fewer at its end); how many."""
        k = min(k, len(self.out) - self.at)
        self.drafter.extend(0, self.out[self.at:self.at + k])
        self.at += k
        self.seq_len += k
        return k


class Fixed:
    """Every step of one tree size."""

    def __init__(self, size: int):
        self.size = size

    def choose(self, bucket: int, seats: list[Seat]) -> int:
        return self.size

    def record(self, seat: Seat, offered: int, accepted: int) -> None:
        pass

    def drop(self, seat: Seat) -> None:
        pass


class Auto:
    """:class:`SpecPolicy` in ``auto``, calibrated with the costs, one record per request."""

    def __init__(self, costs: dict[int, dict[int, float]], tree_size: int):
        calibrated = StepCosts()
        for bucket, sizes in costs.items():
            for n, seconds in sizes.items():
                calibrated.calibrate(bucket, n, seconds)
        self.policy = SpecPolicy(tree_size, "auto", costs=calibrated, buckets=sorted(costs))

    def choose(self, bucket: int, seats: list[Seat]) -> int:
        _, records, _ = self.policy.batch(seats)
        return self.policy.choose(bucket, records)

    def record(self, seat: Seat, offered: int, accepted: int) -> None:
        self.policy.records[seat.rid].add(offered, accepted)

    def drop(self, seat: Seat) -> None:
        self.policy.drop([seat.rid])


def replay(outputs: list[tuple[list[int], list[int]]], costs: dict[int, dict[int, float]], batch: int,
           chooser) -> dict:
    """The outputs through ``batch`` seats, first come first served, each step's size from
    ``chooser``: ``{"seconds", "tokens", "steps": {size: count}}``. A plain step scores a matched
    request's first draft; a step of n nodes offers every request n - 1 drafts (a chain with no
    match accepts none) and commits the accepted ones and one more; the records reach the chooser
    after its next choice, as the overlapped loop's do."""
    buckets = sorted(costs)
    waiting = [Seat(i, prompt, out) for i, (prompt, out) in enumerate(outputs)]
    seats, pending, steps, seconds, tokens = [], [], Counter(), 0.0, 0
    while waiting or seats:
        while waiting and len(seats) < batch:
            seats.append(waiting.pop(0))
        bucket = next(b for b in buckets if b >= len(seats))
        n = chooser.choose(bucket, seats)
        for args in pending:
            chooser.record(*args)
        pending = []
        steps[n] += 1
        seconds += costs[bucket][n]
        for seat in seats:
            run = seat.run(max(n - 1, 1))
            if n == 1:
                if run is not None:
                    pending.append((seat, 1, int(run > 0)))
                tokens += seat.commit(1)
            else:
                pending.append((seat, n - 1, run or 0))
                tokens += seat.commit((run or 0) + 1)
        for seat in [s for s in seats if s.at >= len(s.out)]:
            chooser.drop(seat)
            seats.remove(seat)
            pending = [p for p in pending if p[0] is not seat]
    return {"seconds": seconds, "tokens": tokens, "steps": dict(sorted(steps.items()))}


def replay_rows(outputs, costs: dict[int, dict[int, float]], batch: int) -> list[dict]:
    """Plain, every fixed size and ``auto`` at ``batch``: seconds, speedup over plain, tokens per step,
    over the buckets up to the smallest that holds ``batch`` and the sizes all of them know."""
    top = min((b for b in costs if b >= batch), default=None)
    if top is None:
        raise ValueError(f"batch {batch}: the step costs have no batch bucket that large (largest {max(costs)})")
    costs = {b: v for b, v in costs.items() if b <= top}
    sizes = sorted(set.intersection(*(set(v) for v in costs.values())))
    settings = {"plain" if n == 1 else f"fixed {n}": Fixed(n) for n in sizes}
    settings[f"auto{max(sizes)}"] = Auto(costs, max(sizes))
    rows = []
    for name, chooser in settings.items():
        got = replay(outputs, costs, batch, chooser)
        rows.append({"batch": batch, "setting": name, **got,
                     "tokens_per_step": got["tokens"] / sum(got["steps"].values())})
    plain = rows[0]["seconds"]
    for row in rows:
        row["speedup"] = plain / row["seconds"]
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-report", type=Path, required=True,
                        help="a bench_engine report with a plain run at batch 1 (its outputs) and auto*-device runs")
    parser.add_argument("--costs-report", type=Path, default=None, help="the step costs' report (default: the same)")
    parser.add_argument("--prompts", type=Path, default=Path("bench/data/workload-check.jsonl"))
    parser.add_argument("--model", default=None, help="the GGUF file whose tokenizer encodes the prompts")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 4])
    parser.add_argument("--json", type=Path, default=Path("reports/bench_device_policy_replay.json"))
    args = parser.parse_args(argv)
    try:
        outputs = [(prompt, out) for _, prompt, out in
                   load_outputs(args.engine_report, args.prompts, Tokenizer.from_gguf(args.model), None)]
        costs = step_costs(json.loads((args.costs_report or args.engine_report).read_text()))
        if not costs or 1 not in costs:
            raise ValueError(f"{args.costs_report or args.engine_report}: no auto*-device run with step costs "
                             "of batch bucket 1")
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        rows = [row for b in args.batch_sizes for row in replay_rows(outputs, costs, b)]
    except ValueError as exc:
        parser.error(str(exc))
    console = make_console(160)
    table = make_table(f"device-drafter policy replayed over {len(outputs)} outputs of {args.engine_report.name}",
                       ["batch", "setting", "speedup over plain", "tokens / step (all seats)", "steps by size"],
                       left=("setting", "steps by size"))
    for r in rows:
        table.add_row(str(r["batch"]), r["setting"], f"{r['speedup']:.3f}x", f"{r['tokens_per_step']:.2f}",
                      ", ".join(f"{n}: {c}" for n, c in r["steps"].items()))
    console.print(table)
    report = {**report_header(SCHEMA, get_backend("cpu")), "engine_report": str(args.engine_report),
              "costs_report": str(args.costs_report or args.engine_report), "prompts": str(args.prompts),
              "step_costs_s": {str(b): {str(n): s for n, s in v.items()} for b, v in costs.items()}, "rows": rows}
    write_report(args.json, report, console)
    return rows


if __name__ == "__main__":
    main()

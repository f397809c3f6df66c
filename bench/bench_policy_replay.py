"""Replay the speculation policy over real greedy outputs: acceptance by match length, and the
speedup each way of choosing tree sizes gives at measured step costs.

Our plain engine decodes every prompt of a workload greedily on the CPU; each output then plays
the target, request by request (batch 1): at every step a prompt-lookup drafter
(:class:`~ngram_hal.speculative.drafter.LinearDrafter`) drafts from the prompt and the tokens
committed so far, and a draft is accepted when it equals the output's next token. Two tables:

  acceptance  by the length of the match a draft continues, at every position of the outputs:
              how often the first draft is accepted, and how many of 15 drafts on average
  replay      per kind, the speedup over plain decoding (plain steps' seconds over the chosen
              steps' seconds) of each fixed tree size, of ``auto`` scoring each request by its own
              recent steps, of ``auto`` scoring each draft by its match class (the engine's way
              with a host drafter), and of a clairvoyant choice of each step's size

The policy rows run :class:`~ngram_hal.engine.policy.SpecPolicy` itself (one for the whole
workload, as an engine keeps one), calibrated with the step costs. These are measured here by
default (our engine at batch 1, each tree size with the linear drafter, the median of its
steps' medians over the first prompts), or given with ``--costs``.

    python bench/bench_policy_replay.py [--prompts FILE] [--max-new-tokens 64]
        [--costs 1=0.0168,2=0.020,4=0.0237,8=0.0362] [--json reports/bench_policy_replay.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vs_transformers import Ours  # noqa: E402
from common import make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.backend import OPS  # noqa: E402
from ngram_hal.engine.gguf_loader import find_model_file  # noqa: E402
from ngram_hal.engine.model import LlamaModel  # noqa: E402
from ngram_hal.engine.policy import SpecPolicy, StepCosts, tree_sizes  # noqa: E402
from ngram_hal.engine.tokenizer import Tokenizer  # noqa: E402
from ngram_hal.engine.workload import load_prompts  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402
from ngram_hal.speculative.drafter import LinearDrafter  # noqa: E402

SCHEMA = "ngram-hal-bench-policy-replay/1"
LOOKAHEAD = 15
"""Drafts a replay step compares with the output (the acceptance table's chain length)."""


def parse_costs(text: str) -> dict[int, float]:
    """``"1=0.0168,2=0.020"`` -> {tree size: seconds}; size 1 (plain) must be given."""
    costs = {}
    for item in text.split(","):
        size, _, seconds = item.partition("=")
        try:
            costs[int(size)] = float(seconds)
        except ValueError:
            raise SystemExit(f"--costs: expected SIZE=SECONDS items, got {item!r}") from None
    if 1 not in costs or any(n < 1 or s <= 0 for n, s in costs.items()):
        raise SystemExit(f"--costs: need size 1 and positive seconds, got {text!r}")
    return costs


def accepted_run(drafter: LinearDrafter, out: list[int], at: int, lookahead: int) -> int:
    """How many of the next ``lookahead`` drafts of request 0 of ``drafter`` equal ``out[at:]``
    in a row: the drafts the output, playing the target, accepts."""
    chain = drafter.draft([0], lookahead + 1).tokens[1:].tolist()
    run = 0
    while run < lookahead and at + run < len(out) and chain[run] == out[at + run]:
        run += 1
    return run


def steps_of(prompt: list[int], out: list[int], choose: Callable[[int, int], int]):
    """Replay ``out`` after ``prompt``: yields ``(match length, accepted run, size)`` per step, the
    size from ``choose(match length, run)`` (a policy reads only the match length); the step
    commits ``min(run + 1, size)`` tokens. Where nothing matched the step is plain whatever was
    chosen, as the engine cuts a step to its drafted nodes."""
    drafter = LinearDrafter()
    drafter.add_request(0, prompt + out[:1])
    i = 1
    while i < len(out):
        (length,) = drafter.match_lengths([0])
        run = accepted_run(drafter, out, i, LOOKAHEAD)
        size = choose(length, run)
        size = size if length else 1
        yield length, run, size
        k = min(run + 1, size, len(out) - i)
        drafter.extend(0, out[i:i + k])
        i += k


def acceptance_by_match(outputs: list[dict]) -> list[dict]:
    """Every position of every output: first-draft acceptance and mean accepted run by match length."""
    runs = defaultdict(list)
    for r in outputs:
        for length, run, _ in steps_of(r["prompt"], r["out"], lambda length, run: 1):
            runs[length].append(run)
    return [{"match_length": n, "positions": len(v), "p_first": sum(x > 0 for x in v) / len(v),
             "mean_run": sum(v) / len(v)} for n, v in sorted(runs.items())]


def replay_fixed(outputs: list[dict], costs: dict[int, float], size: int) -> dict[str, float]:
    """Seconds per kind with every step of ``size`` nodes."""
    seconds = defaultdict(float)
    for r in outputs:
        for _, _, n in steps_of(r["prompt"], r["out"], lambda length, run: size):
            seconds[r["kind"]] += costs[n]
    return seconds


def replay_clairvoyant(outputs: list[dict], costs: dict[int, float]) -> dict[str, float]:
    """Seconds per kind choosing each step's size knowing the run it will accept: the size with the
    fewest seconds per committed token (a bound for any policy over these drafts)."""
    def best(length: int, run: int) -> int:
        return min(costs, key=lambda n: costs[n] / min(run + 1, n))

    seconds = defaultdict(float)
    for r in outputs:
        for _, _, n in steps_of(r["prompt"], r["out"], best):
            seconds[r["kind"]] += costs[n]
    return seconds


def replay_policy(outputs: list[dict], costs: dict[int, float], by_match: bool) -> dict[str, float]:
    """Seconds per kind with the sizes :class:`SpecPolicy` (``auto``, calibrated with ``costs``)
    chooses, scoring by match class (``by_match``) or by each request's own record; each step's
    drafts are recorded as the engine records them (a plain step scores its first draft)."""
    calibrated = StepCosts()
    for n, s in costs.items():
        calibrated.calibrate(1, n, s)
    policy = SpecPolicy(max(costs), "auto", costs=calibrated)
    seconds = defaultdict(float)
    for b, r in enumerate(outputs):
        request = SimpleNamespace(rid=str(b), seq_len=len(r["prompt"]))
        scored = []

        def choose(length: int, run: int) -> int:
            bucket, records, context = policy.batch([request], [length] if by_match else None)
            scored[:] = records  # the record this step's drafts are added to
            return policy.choose(bucket, records, context)

        for length, run, n in steps_of(r["prompt"], r["out"], choose):
            if length:
                offered = max(n - 1, 1)
                scored[0].add(offered, min(run, offered))
            seconds[r["kind"]] += costs[n]
        policy.drop([request.rid])
    return seconds


def replay_table(outputs: list[dict], costs: dict[int, float]) -> dict[str, dict[str, float]]:
    """{setting: {kind: speedup over plain, and "all"}} for every setting of the replay."""
    plain = defaultdict(float)
    for r in outputs:
        plain[r["kind"]] += costs[1] * (len(r["out"]) - 1)
    settings = {f"fixed {n}": replay_fixed(outputs, costs, n) for n in sorted(costs) if n > 1}
    settings["auto, own records"] = replay_policy(outputs, costs, by_match=False)
    settings["auto, by match"] = replay_policy(outputs, costs, by_match=True)
    settings["clairvoyant"] = replay_clairvoyant(outputs, costs)
    table = {}
    for name, seconds in settings.items():
        row = {kind: plain[kind] / seconds[kind] for kind in plain}
        row["all"] = sum(plain.values()) / sum(seconds.values())
        table[name] = row
    return table


def greedy_outputs(model: LlamaModel, tok: Tokenizer, specs, max_new: int) -> list[dict]:
    """Each prompt's greedy output from our plain engine, one request at a time."""
    plain = Ours(model, tok, 1, "trie")
    outputs = []
    for s in specs:
        ids = tok.encode_chat(s.messages)
        out, _, _ = plain(ids, min(max_new, s.max_new_tokens))
        outputs.append({"id": s.id, "kind": s.kind, "prompt": ids, "out": out})
    return outputs


def measure_costs(model: LlamaModel, tok: Tokenizer, specs, sizes: list[int], max_new: int) -> dict[int, float]:
    """Median over ``specs`` of the median seconds of our engine's verify steps per tree size at
    batch 1 (the linear drafter at a fixed size; plain for size 1)."""
    costs = {}
    for n in sizes:
        ours = Ours(model, tok, n, "linear")
        medians = []
        for s in specs:
            ours(tok.encode_chat(s.messages), max_new)
            measured = ours.engine.policy.costs.measured(1, n)
            if measured is not None:
                medians.append(measured)
        costs[n] = statistics.median(medians)
    return costs


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="bench/data/workload-check.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--tree-size", type=int, default=8, metavar="D", help="the largest size (auto's sizes up to D)")
    ap.add_argument("--costs", type=parse_costs, default=None,
                    help="step seconds by tree size, SIZE=SECONDS,...; measured here by default")
    ap.add_argument("--cost-prompts", type=int, default=1, help="prompts of each kind (the first ones) that time the steps")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", default="reports/bench_policy_replay.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    backend = get_backend("cpu", require=OPS)
    model = LlamaModel.from_gguf(backend, find_model_file(), torch.float32)
    tok = Tokenizer(model.tokenizer_metadata)
    specs = load_prompts(args.prompts)
    console = make_console(160)
    outputs = greedy_outputs(model, tok, specs, args.max_new_tokens)
    costs = args.costs
    if costs is None:
        kinds = sorted({s.kind for s in specs})
        timed = [s for k in kinds for s in [x for x in specs if x.kind == k][:args.cost_prompts]]
        costs = measure_costs(model, tok, timed, tree_sizes(args.tree_size), args.max_new_tokens)
    acceptance = acceptance_by_match(outputs)
    table = replay_table(outputs, costs)

    accept_table = make_table("Drafts by the length of the match they continue (every position)",
                              ["match length", "positions", "first draft accepted", f"mean run of {LOOKAHEAD}"])
    for row in acceptance:
        accept_table.add_row(str(row["match_length"]), str(row["positions"]), f"{row['p_first']:.0%}",
                             f"{row['mean_run']:.2f}")
    console.print(accept_table)
    kinds = sorted(k for k in next(iter(table.values())) if k != "all") + ["all"]
    costs_text = ", ".join(f"{n}: {s * 1e3:.1f} ms" for n, s in sorted(costs.items()))
    replay = make_table(f"Replayed speedup over plain decoding (step costs {costs_text})", ["setting", *kinds],
                        left=("setting",))
    for name, row in table.items():
        replay.add_row(name, *(f"{row[k]:.3f}x" for k in kinds))
    console.print(replay)
    report = {**report_header(SCHEMA, backend), "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "step_costs_s": {str(n): s for n, s in sorted(costs.items())}, "costs_measured": args.costs is None,
              "acceptance_by_match_length": acceptance, "replay_speedup": table,
              "outputs": {r["id"]: {"kind": r["kind"], "tokens": len(r["out"])} for r in outputs}}
    write_report(args.json, report, console)
    return report


if __name__ == "__main__":
    main()

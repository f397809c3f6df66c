"""Replay the device drafter's chains over known greedy outputs: what each rule for a chain's
active nodes costs in accepted drafts.

A verify step checks only a chain's active nodes (:func:`ngram_hal.speculative.lookup.active_nodes`,
from the length of the match the chain continues); the nodes past them are never accepted. This
takes the greedy outputs of a ``bench/bench_engine.py`` report (its plain run's token ids, each
request once), and replays every request alone: at each step :func:`record_and_draft` (the device
drafter's torch implementation) drafts a chain of ``--tree-size`` nodes from the prompt and the
tokens committed so far, the output plays the target (a draft is accepted while it equals the
output's next token, up to the active nodes), and the accepted drafts plus one token are committed.
Greedy verification commits exactly these tokens, so tokens per verify step here are those of the
engine at batch 1 (batched runs commit the same tokens; their step counts differ only where a
request's budget ends a chain early). Two tables:

  rules       per rule (active nodes after no match / after a one-token match; longer matches keep
              every node): tokens per verify step, its ratio to every node active, and the mean
              active nodes a step verifies (what the attention walks)
  acceptance  by match length with every node active: positions, their share, mean accepted
              drafts, and the accepted drafts a rule of k nodes would lose past node k

    python bench/bench_active_replay.py --outputs docs/bench/h100-active/engine-b16-after.json
        [--prompts bench/data/workload-check.jsonl] [--rules n/n,1/5,1/8] [--json FILE]
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.engine.tokenizer import Tokenizer  # noqa: E402
from ngram_hal.engine.workload import load_prompts  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402
from ngram_hal.speculative.lookup import DeviceDrafter, active_nodes, record_and_draft  # noqa: E402

SCHEMA = "ngram-hal-bench-active-replay/1"
DEFAULT_RULE = "active_nodes"
"""The library's rule, always replayed beside ``--rules``."""
MAX_NGRAM, MIN_NGRAM = (inspect.signature(DeviceDrafter).parameters[p].default for p in ("max_ngram", "min_ngram"))
"""The device drafter's defaults, which the engine drafts with."""

Rule = Callable[[int, int], int]
"""(match length, tree size) -> active nodes."""


def parse_rule(text: str) -> Rule:
    """``"1/5"`` -> a rule: 1 node after no match, 5 after a one-token match, every node after a
    longer one; ``n`` stands for every node (``"n/n"``: every node always)."""
    parts = text.split("/")
    if len(parts) != 2 or not all(p == "n" or (p.isdigit() and int(p) > 0) for p in parts):
        raise ValueError(f"--rules: {text!r} is not NONE/ONE (positive counts or n, e.g. 1/5 or n/n)")
    none, one = (None if p == "n" else int(p) for p in parts)

    def rule(match: int, tree_size: int) -> int:
        k = tree_size if match > 1 else one if match == 1 else none
        return tree_size if k is None else min(k, tree_size)
    return rule


def library_rule(match: int, tree_size: int) -> int:
    """:func:`active_nodes` for one chain."""
    return int(active_nodes(torch.tensor([match]), tree_size)[0])


def replay(prompt: Sequence[int], out: Sequence[int], tree_size: int, rule: Rule) -> list[tuple[int, int, int]]:
    """One request's decode with the output as the target: ``(match length, active nodes, accepted
    drafts)`` per verify step. ``out[0]`` comes from the prefill; each step then commits its
    accepted drafts and one more token, until ``out`` is committed (the last step accepts at most
    the drafts before the output's last token, as a request's token budget does)."""
    stream = list(prompt) + list(out)
    width = len(stream) + tree_size
    table = torch.zeros((1, width), dtype=torch.int64)
    table[0, :len(prompt)] = torch.tensor(prompt, dtype=torch.int64)
    committed, count, steps = [stream[len(prompt)]], len(prompt) + 1, []
    match = torch.zeros(1, dtype=torch.int64)
    while count < len(stream):
        tokens = torch.zeros(tree_size, dtype=torch.int64)
        tokens[:len(committed)] = torch.tensor(committed, dtype=torch.int64)
        chain = record_and_draft(table, torch.zeros(1, dtype=torch.int64), tokens,
                                 torch.tensor([len(committed)]), torch.tensor([count - 1]), tree_size,
                                 MAX_NGRAM, MIN_NGRAM, match=match).tolist()
        active = rule(int(match[0]), tree_size)
        truth = stream[count:min(count + active, len(stream)) - 1]  # the last token is the bonus's
        accepted = next((i for i, (d, t) in enumerate(zip(chain[1:active], truth)) if d != t), len(truth))
        committed = stream[count:count + accepted + 1]
        count += len(committed)
        steps.append((int(match[0]), active, accepted))
    return steps


def rule_rows(outputs: Sequence[tuple[list[int], list[int]]], tree_size: int,
              rules: dict[str, Rule]) -> list[dict]:
    """Per rule: tokens per verify step over ``outputs`` ((prompt, output) pairs), its ratio to
    every node active, the mean active nodes, steps."""
    rows = []
    for name, rule in rules.items():
        steps = [s for prompt, out in outputs for s in replay(prompt, out, tree_size, rule)]
        tokens = sum(len(out) - 1 for _, out in outputs)
        rows.append({"rule": name, "steps": len(steps), "tokens": tokens,
                     "tokens_per_verify_step": tokens / len(steps),
                     "mean_active_nodes": sum(a for _, a, _ in steps) / len(steps)})
    every = rows[0]["tokens_per_verify_step"]
    for row in rows:
        row["vs_every_node"] = row["tokens_per_verify_step"] / every
    return rows


def acceptance_rows(outputs: Sequence[tuple[list[int], list[int]]], tree_size: int,
                    cuts: Sequence[int]) -> list[dict]:
    """By match length (8 and more together), with every node active: positions, share, mean
    accepted drafts, and the drafts a chain of k nodes would not have verified, per k in ``cuts``."""
    every = parse_rule("n/n")
    by_match: dict[int, list[int]] = defaultdict(list)
    for prompt, out in outputs:
        for match, _, accepted in replay(prompt, out, tree_size, every):
            by_match[min(match, MAX_NGRAM)].append(accepted)
    total = sum(len(v) for v in by_match.values())
    return [{"match_length": m, "positions": len(v), "share": len(v) / total, "mean_accepted": sum(v) / len(v),
             "lost_past": {str(k): sum(max(0, a - (k - 1)) for a in v) for k in cuts}}
            for m, v in sorted(by_match.items())]


def load_outputs(report_path: Path, prompts_path: Path | None, tokenizer: Tokenizer,
                 limit: int | None) -> list[tuple[str, list[int], list[int]]]:
    """(id, prompt ids, output ids) of each request of a ``bench_engine`` report's plain run, once."""
    report = json.loads(report_path.read_text())
    plain = next((r for r in report.get("runs", []) if r.get("run") == "plain" and r.get("token_ids")), None)
    if plain is None:
        raise ValueError(f"--outputs {report_path}: no plain run with token ids (a bench_engine report)")
    specs = {s.id: s for s in load_prompts(prompts_path)}
    seen, outputs = set(), []
    for rid, ids in zip(plain["requests"], plain["token_ids"]):
        if rid in seen:
            continue
        if rid not in specs:
            raise ValueError(f"--outputs {report_path}: request {rid!r} is not in the prompts file")
        seen.add(rid)
        outputs.append((rid, tokenizer.encode_chat(specs[rid].messages), list(ids)))
    return outputs[:limit]


def at_least(low: int):
    """An argparse type: an int of at least ``low``."""
    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or int(text) < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an int of at least {low}")
        return int(text)
    return parse


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--outputs", type=Path, required=True, help="a bench_engine report with a plain run")
    parser.add_argument("--prompts", type=Path, default=Path("bench/data/workload-check.jsonl"))
    parser.add_argument("--model", default=None, help="the GGUF file whose tokenizer encodes the prompts")
    parser.add_argument("--tree-size", type=at_least(2), default=16)
    parser.add_argument("--rules", default="1/5,1/8", help="NONE/ONE pairs beside every node and active_nodes")
    parser.add_argument("--limit", type=at_least(1), default=None, help="replay only the first requests")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    try:
        rules = {"n/n": parse_rule("n/n"), DEFAULT_RULE: library_rule}
        rules.update({text: parse_rule(text) for text in args.rules.split(",") if text})
        outputs = load_outputs(args.outputs, args.prompts, Tokenizer.from_gguf(args.model), args.limit)
        if not any(len(out) > 1 for _, _, out in outputs):
            raise ValueError(f"--outputs {args.outputs}: no request has two output tokens or more to replay")
    except ValueError as exc:
        parser.error(str(exc))
    pairs = [(prompt, out) for _, prompt, out in outputs]
    rows = rule_rows(pairs, args.tree_size, rules)
    cuts = sorted({rule(m, args.tree_size) for rule in rules.values() for m in (0, 1)} - {args.tree_size})
    acceptance = acceptance_rows(pairs, args.tree_size, cuts)

    console = make_console()
    table = make_table(f"active-node rules, chains of {args.tree_size}, {len(pairs)} requests of "
                       f"{args.outputs.name}", ["rule", "tok/verify", "vs every node", "mean active", "steps"],
                       left=["rule"])
    for r in rows:
        table.add_row(r["rule"], f"{r['tokens_per_verify_step']:.3f}", f"{r['vs_every_node']:.3f}x",
                      f"{r['mean_active_nodes']:.2f}", str(r["steps"]))
    console.print(table)
    table = make_table("acceptance by match length, every node active",
                       ["match", "positions", "share", "mean accepted", *(f"lost past {k}" for k in cuts)])
    for r in acceptance:
        table.add_row(str(r["match_length"]) + ("+" if r["match_length"] == MAX_NGRAM else ""), str(r["positions"]),
                      f"{r['share']:.0%}", f"{r['mean_accepted']:.2f}", *(str(r["lost_past"][str(k)]) for k in cuts))
    console.print(table)
    report = {**report_header(SCHEMA, get_backend("cpu")), "outputs": str(args.outputs), "prompts": str(args.prompts),
              "tree_size": args.tree_size, "requests": [rid for rid, _, _ in outputs], "rules": rows,
              "acceptance_by_match_length": acceptance}
    if args.json:
        write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Offline acceptance: mean tokens committed per verify step, trie drafter vs prompt lookup.

A known output is replayed as the target model's greedy output (``replay.py``): at each step
the drafter proposes a tree of D nodes, the walk from the root along the true next tokens
accepts drafts, and the accepted drafts plus one bonus token are committed. Tokens per step is
output tokens / verify steps (1.0 without speculation).

Scenarios, over real files (Python sources and documentation prose, ``realtext.py``), a batch
of requests decoded together so that the shared corpus also learns across requests:
  edit      the prompt holds the file with every fifth chunk of 48 tokens left out, then asks
            for the file; the output is the whole file (a prompt that contains most of it)
  continue  the prompt is the text before, the output the text after (no copy to find)

    python bench/bench_acceptance.py [--requests 8] [--output 1536] [--tree-size 8 16]
                                     [--json reports/bench_acceptance.json]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import machine, make_console, make_table, utc_now, write_report  # noqa: E402
from realtext import load_tokens  # noqa: E402
from replay import Replay  # noqa: E402

from ngram_hal.speculative.drafter import LinearDrafter, TrieDrafter  # noqa: E402

DRAFTERS = {
    "trie-bfs": lambda: TrieDrafter(),
    "trie-frequency": lambda: TrieDrafter(mode="frequency"),
    "trie-per-request": lambda: TrieDrafter(shared=False),
    "linear": lambda: LinearDrafter(),
}
CHUNK = 48
SEPARATOR_LEN = 16


def edit_case(text: np.ndarray, output: int) -> tuple[np.ndarray, int]:
    """(stream, prompt length): the prompt is the output with every fifth chunk dropped."""
    out = text[:output]
    kept = [out[i:i + CHUNK] for i in range(0, out.size, CHUNK) if (i // CHUNK) % 5 != 4]
    separator = text[output:output + SEPARATOR_LEN]  # unrelated real tokens between the two
    prompt = np.concatenate(kept + [separator])
    return np.concatenate([prompt, out]), prompt.size


def continue_case(text: np.ndarray, output: int, before: int) -> tuple[np.ndarray, int]:
    """(stream, prompt length): ``before`` tokens of text, then ``output`` more."""
    return text[: before + output], before


def replay(name: str, streams: list[np.ndarray], prompt_lens: list[int], D: int) -> dict:
    run = Replay(DRAFTERS[name](), streams, prompt_lens, D)
    run.prefill()
    steps = np.zeros(len(streams), np.int64)
    while not run.done().all():
        steps += ~run.done()
        run.step()
    outputs = np.array([s.size - n for s, n in zip(streams, prompt_lens)])
    return {"drafter": name, "tree_size": D, "steps": int(steps.sum()), "output_tokens": int(outputs.sum()),
            "tokens_per_step": float(outputs.sum() / steps.sum()),
            "tokens_per_step_by_request": (outputs / steps).round(3).tolist()}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8, help="requests per scenario (half code, half prose)")
    ap.add_argument("--output", type=int, default=1536, help="output tokens per request")
    ap.add_argument("--before", type=int, default=4096, help="prompt tokens in the 'continue' scenario")
    ap.add_argument("--tree-size", type=int, nargs="+", default=[8, 16], metavar="D")
    ap.add_argument("--drafters", nargs="+", default=list(DRAFTERS), choices=list(DRAFTERS))
    ap.add_argument("--cache", type=Path, default=Path("reports/cache"))
    ap.add_argument("--json", type=Path, default=Path("reports/bench_acceptance.json"))
    args = ap.parse_args(argv)

    span = args.before + args.output + SEPARATOR_LEN
    half = (args.requests + 1) // 2
    code, tokenizer = load_tokens("code", half * span, args.cache)
    prose, _ = load_tokens("prose", half * span, args.cache)
    texts = [(code if b % 2 == 0 else prose)[(b // 2) * span:(b // 2 + 1) * span] for b in range(args.requests)]
    cases = {
        "edit": [edit_case(t, args.output) for t in texts],
        "continue": [continue_case(t, args.output, args.before) for t in texts],
    }

    console = make_console()
    rows = []
    for scenario, case in cases.items():
        streams, prompt_lens = [s for s, _ in case], [n for _, n in case]
        for D in args.tree_size:
            for name in args.drafters:
                row = {"scenario": scenario, **replay(name, streams, prompt_lens, D)}
                rows.append(row)
                console.log(f"{scenario:8s} D={D:2d} {name:16s} {row['tokens_per_step']:.3f} tokens/step")

    ratio = "linear" in args.drafters and "trie-bfs" in args.drafters
    table = make_table(f"Mean tokens committed per verify step (greedy replay), tokens: {tokenizer}",
                       ["scenario", "D", *args.drafters] + (["trie-bfs / linear"] if ratio else []),
                       left=("scenario",))
    got = {(r["scenario"], r["tree_size"], r["drafter"]): r["tokens_per_step"] for r in rows}
    for scenario in cases:
        for D in args.tree_size:
            cells = [f"{got[(scenario, D, n)]:.3f}" for n in args.drafters]
            if ratio:
                cells.append(f"{got[(scenario, D, 'trie-bfs')] / got[(scenario, D, 'linear')]:.2f}x")
            table.add_row(scenario, str(D), *cells)
    console.print(table)

    report = {
        "bench": "acceptance",
        "time": utc_now(),
        "machine": machine(),
        "tokenizer": tokenizer,
        "requests": args.requests, "output_tokens_per_request": args.output,
        "rows": rows,
    }
    write_report(args.json, report, console)
    return report


if __name__ == "__main__":
    main()

"""``ngram-hal run``: the engine from the command line.

Everything a user can get wrong is checked before the model loads (:mod:`ngram_hal.cli.checks`):
option values when the arguments are parsed (their constraints come from :class:`SamplingParams`
and :class:`EngineConfig`), then the prompts file, the report's destination, the model file and
the backend, and then, with the tokenizer read from the model file's metadata, that every prompt
fits the context. Results go to stdout; what the command is doing (tokenizer and model load,
kernel compilation, the tokens of each run) goes to stderr (:mod:`ngram_hal.engine.progress`:
spinners and bars on a terminal, time-stamped lines in a pipe).
"""

from __future__ import annotations

import argparse
import math
import sys

from rich.console import Console
from rich.table import Table

from . import parallel
from .checks import check_spec_room, check_tree_room, prompt_specs
from .common import CommandError, check_destination, ratio
from .engine_args import add_engine_arguments
from .setup import Setup, peak_rss_bytes, split_ranks, write_json
from ..options import field_type
from ..engine.engine import EngineConfig
from ..engine.progress import Status
from ..engine.request import SamplingParams
from ..engine.workload import SLICE_S, RunResult, run_side_by_side


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``ngram-hal run``."""
    add_engine_arguments(parser)
    parser.add_argument("--max-new-tokens", type=field_type(SamplingParams, "max_new_tokens"), default=None,
                        metavar="N", help="at most N new tokens per request (default: each prompt line's "
                                          "own budget, 128 for a line without one)")
    parser.add_argument("--prompt", metavar="TEXT", default=None, help="one user message to answer")
    parser.add_argument("--no-spec", action="store_true", help="decode without speculation")
    parser.add_argument("--spec-policy", choices=("always", "auto"), default=None,
                        help="auto (default; always under --tp): each step uses 1, 2, 4, ... or D nodes, whichever "
                             "is measured fastest; always: D nodes")
    parser.add_argument("--no-overlap", action="store_true", help="process each step before launching the next")
    parser.add_argument("--temperature", type=field_type(SamplingParams, "temperature"), default=0.0,
                        help="0 is greedy (default)")
    parser.add_argument("--top-p", type=field_type(SamplingParams, "top_p"), default=1.0, metavar="P",
                        help="sample from the most likely tokens whose probabilities add up to P, in (0, 1] "
                             "(default 1: all of them; with --temperature above 0)")
    parser.add_argument("--top-k", type=field_type(SamplingParams, "top_k"), default=0, metavar="K",
                        help="sample from the K most likely tokens (default 0: all of them; with --temperature "
                             "above 0)")
    parser.add_argument("--seed", type=field_type(SamplingParams, "seed"), default=0, metavar="N",
                        help="seed of the sampling, 0 <= N < 2**64: the same seed samples the same tokens "
                             "(default 0; with --temperature above 0)")
    parser.add_argument("--batch-size", type=field_type(EngineConfig, "max_running"), default=16,
                        help="most requests decoding at once (default 16)")
    parser.add_argument("--compare", action="store_true",
                        help="also decode without speculation, the two runs taking turns, and report the speedup")
    parser.add_argument("--json", metavar="PATH", default=None, help="write requests and totals as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the summary, not the texts")


def run_command(args: argparse.Namespace) -> int:
    """Generate for the prompts, print the texts and a summary; with ``--compare`` the speedup too."""
    if args.compare and args.no_spec:
        raise CommandError("--compare compares speculation with plain decoding: drop --no-spec")
    args.spec_policy = parallel.spec_policy(args)
    specs = prompt_specs(args)
    if args.tree_size is not None:
        check_tree_room(args.tree_size, args.max_context_len)
    check_destination("--json", args.json)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens or 128,
                            seed=args.seed if args.temperature > 0 else None)
    split = split_ranks(run_command, args, specs, params)
    if split is not None:
        return split
    console, status = Console(), Status()
    setup = Setup(args, status, check=lambda tokenizer: check_spec_room(tokenizer, specs, args, params))
    tree_size = 1 if args.no_spec else args.tree_size
    overlap = not args.no_overlap
    labels = ["speculative" if tree_size > 1 else "plain"] + (["plain"] if args.compare else [])
    engines = setup.warm_up(lambda: [setup.engine(tree_size, overlap, args.batch_size, args.spec_policy)]
                            + ([setup.engine(1, overlap, args.batch_size)] if args.compare else []),
                            specs, params, args.batch_size)
    runs = list(zip(labels, engines))
    with status.progress() as progress:
        # Under --tp every rank must run the same steps in the same order: whole runs, not time slices.
        results = run_side_by_side(runs, setup.tokenizer, specs, params, progress,
                                   slice_s=math.inf if args.tp > 1 else SLICE_S)
    result = results[0]
    baseline = results[1] if args.compare else None
    same = [a.token_ids == b.token_ids for a, b in zip(result.requests, baseline.requests)] if baseline else None
    if not args.quiet:
        _print_texts(console, result, baseline, same)
    console.print(_requests_table(result, same))
    console.print(_runs_table([(runs[0][0], result)] + ([("plain", baseline)] if baseline else []), baseline))
    console.print(summary_line(result, baseline, same, greedy=params.greedy, invariant=setup.model.batch_invariant),
                  highlight=False, soft_wrap=True)
    setup.warn_if_busy(console)
    if args.json:
        payload = {"setup": setup.describe(), "run": result.model_dump(), "peak_rss_bytes": peak_rss_bytes()}
        if baseline is not None:
            payload["baseline"] = baseline.model_dump()
            payload["speedup"] = ratio(result.totals.tokens_per_s, baseline.totals.tokens_per_s)
            payload["same_tokens"] = same
        write_json(args.json, payload)
        status.print(f"wrote {args.json}")
    failed = [r for r in result.requests if r.error]
    for r in failed:
        print(f"error: request {r.id}: {r.error}", file=sys.stderr)
    return 1 if failed else 0


def _print_texts(console: Console, result: RunResult, baseline: RunResult | None, same: list[bool] | None) -> None:
    for i, rec in enumerate(result.requests):
        console.rule(f"[bold]{rec.id}[/] ({rec.kind}, {len(rec.token_ids)} tokens, {rec.finish_reason})")
        console.print(rec.error if rec.error else rec.text, markup=False, highlight=False)
        if same is not None and not same[i]:
            other = baseline.requests[i]
            console.rule(f"[bold]{rec.id}[/], plain decoding ({len(other.token_ids)} tokens): a different text",
                         style="yellow")
            console.print(other.error if other.error else other.text, markup=False, highlight=False)


def summary_line(result: RunResult, baseline: RunResult | None, same: list[bool] | None, greedy: bool,
                 invariant: bool = False) -> str:
    """The run in one line: the speedup, tokens per verify step, identical tokens, and why greedy
    tokens may differ (sampling; outside the batch-invariant mode, ``invariant`` False, a row's
    rounding follows the rows beside it)."""
    t = result.totals
    if baseline is None:
        return (f"{t.output_tokens} tokens in {t.wall_s:.1f} s ({_rate(t.tokens_per_s)} tok/s), "
                f"{t.tokens_per_verify_step:.2f} tok/verify step")
    b = baseline.totals
    speedup = ratio(t.tokens_per_s, b.tokens_per_s)
    ids = [r.id for r, ok in zip(result.requests, same) if not ok]
    identical = f"identical tokens: {sum(same)}/{len(same)}"
    if ids:
        why = ("; expected when sampling" if not greedy else "" if invariant else
               "; these numerics round a row by the rows beside it: --batch-invariant keeps them all")
        identical += f" (differ: {', '.join(ids)}{why})"
    return (f"speedup {speedup or 0:.2f}x ({_rate(t.tokens_per_s)} vs {_rate(b.tokens_per_s)} tok/s), "
            f"{t.tokens_per_verify_step:.2f} tok/verify step, {identical}")


def _rate(tokens_per_s: float) -> str:
    """A rate in at most five digits, so the summary fits 80 columns at GPU rates too."""
    return f"{tokens_per_s:.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.1f}"


def _requests_table(result: RunResult, same: list[bool] | None) -> Table:
    table = Table(title="requests")
    table.add_column("id", overflow="fold")
    table.add_column("kind")
    for header in ("prompt\ntokens", "output\ntokens", "verify\nsteps", "tokens\n/step"):
        table.add_column(header, justify="right", no_wrap=True)
    table.add_column("finish", no_wrap=True)
    if same is not None:
        table.add_column("same", no_wrap=True)
    for i, r in enumerate(result.requests):
        per = (len(r.token_ids) - 1) / r.verify_steps if r.verify_steps else 0.0
        row = [r.id, r.kind, str(r.prompt_tokens), str(len(r.token_ids)), str(r.verify_steps), f"{per:.2f}",
               r.finish_reason or ""]
        if same is not None:
            row.append("yes" if same[i] else "no")
        table.add_row(*row)
    return table


def _runs_table(runs: list[tuple[str, RunResult]], baseline: RunResult | None) -> Table:
    table = Table(title="summary")
    table.add_column("run", no_wrap=True)
    for header in ("output\ntokens", "tokens\n/verify", "decode\nsteps", "ms\n/step", "time\ns", "tok/s",
                   "speedup"):
        table.add_column(header, justify="right", no_wrap=True)
    for name, res in runs:
        t = res.totals
        speed = ratio(t.tokens_per_s, baseline.totals.tokens_per_s) if baseline else None
        table.add_row(name, str(t.output_tokens), f"{t.tokens_per_verify_step:.2f}", str(t.decode_steps),
                      f"{t.ms_per_decode_step:.0f}", f"{t.wall_s:.1f}", f"{t.tokens_per_s:.1f}",
                      f"{speed:.2f}x" if speed else "")
    return table


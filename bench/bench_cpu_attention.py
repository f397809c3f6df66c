"""CPU attention of few queries over the paged cache: the compiled kernel against torch, side by side.

SmolLM2's heads (9 query heads over 3 KV heads of 64), float32, one block (one request) of 1-4
queries over a context of T keys scattered through a cache of 4,096 slots, the causal mask of
the block's last queries. Two sides, the same inputs, in alternating rounds in one process: the
reference's torch path (the block's keys and values gathered, then masked
``scaled_dot_product_attention``) and :func:`ngram_hal.kernels.cpu.attention.attend`, which reads
each key in place. Both must agree within float32 rounding before anything is timed. Median
microseconds per call of one layer, and the kernel over torch.

    python bench/bench_cpu_attention.py [--threads 1] [--queries 1,2,3,4] [--contexts 100,400,1500]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.options import int_list  # noqa: E402
from ngram_hal.kernels.cpu.attention import KERNEL_QUERIES, attend  # noqa: E402
from ngram_hal.reference import CpuBackend  # noqa: E402
from ngram_hal.reference.attention import _sdpa  # noqa: E402

SLOTS, HQ, H, D = 4096, 9, 3, 64
ROUNDS = 10
"""Rounds of calls of each side in turn: a change in the machine's load hits both sides."""


def case(queries: int, context: int, seed: int = 0):
    """(q [1, Bq, Hq, d], k and v caches [S + 1, H, d], rows [1, T], mask [1, Bq, T])."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, queries, HQ, D, generator=gen)
    k, v = torch.randn(SLOTS + 1, H, D, generator=gen), torch.randn(SLOTS + 1, H, D, generator=gen)
    rows = torch.randperm(SLOTS, generator=gen)[:context].view(1, context)
    cols = torch.arange(context)
    mask = (cols <= torch.arange(context - queries, context).unsqueeze(1)).unsqueeze(0)
    return q, k, v, rows, mask


def alternating_us(sides: dict, calls: int) -> dict[str, float]:
    """Median microseconds of one call of each side, ``calls`` calls each over :data:`ROUNDS`
    rounds that take the sides in turn (after one untimed call of each)."""
    times: dict[str, list[float]] = {name: [] for name in sides}
    for fn in sides.values():
        fn()
    for _ in range(ROUNDS):
        for name, fn in sides.items():
            for _ in range(max(1, calls // ROUNDS)):
                start = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--queries", type=int_list, default=[1, 2, 3, 4], metavar="BQ,...")
    parser.add_argument("--contexts", type=int_list, default=[100, 400, 1500], metavar="T,...")
    parser.add_argument("--calls", type=int, default=300, help="timed calls of each side")
    parser.add_argument("--json", default="reports/bench_cpu_attention.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    console = make_console()
    table = make_table(f"one layer's attention, float32, {args.threads} thread(s): median us per call",
                       ["queries", "keys", "torch (gather + SDPA)", "kernel", "kernel / torch"], left=[])
    results = []
    for queries in args.queries:
        for context in args.contexts:
            q, k, v, rows, mask = case(queries, context)

            def torch_path():
                ks = k.index_select(0, rows.reshape(-1)).view(1, context, H, D)
                vs = v.index_select(0, rows.reshape(-1)).view(1, context, H, D)
                return _sdpa(q, ks, vs, mask, 0.125)

            def kernel():
                return attend(q, k, v, rows, mask, 0.125)

            torch.testing.assert_close(kernel(), torch_path(), rtol=1e-5, atol=1e-5)
            us = alternating_us({"torch": torch_path, "kernel": kernel}, args.calls)
            ratio = us["kernel"] / us["torch"]
            results.append({"queries": queries, "keys": context, "torch_us": us["torch"], "kernel_us": us["kernel"],
                            "kernel_over_torch": ratio})
            table.add_row(str(queries), str(context), f"{us['torch']:.1f}", f"{us['kernel']:.1f}", f"{ratio:.2f}x")
    console.print(table)
    report = {**report_header("ngram-hal/bench-cpu-attention/1", CpuBackend()), "threads": args.threads,
              "kernel_queries": KERNEL_QUERIES, "heads": {"query": HQ, "kv": H, "dim": D}, "results": results}
    write_report(args.json, report, console)
    return report


if __name__ == "__main__":
    main()

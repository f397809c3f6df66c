"""Attention in a captured step's shape: contexts far shorter than the keys the step is bounded by.

A captured decode or verify step bounds every request's keys by the request table's width (2048
positions here), so the kernel's key split is sized for 2048 keys while the contexts hold a few
hundred. Two settings of the ``cuda`` backend run the same calls side by side, one layer,
SmolLM2-135M heads (9 query, 3 KV, 64 wide), bf16, graph-replayed device time:

- **even** (``LaunchConfig.attn_even_split``, the default): each request's own keys are shared
  evenly by the splits;
- **bound**: the 2048-key bound is cut into equal chunks, so the splits past a short context
  have nothing to do and the first ones hold all of it.

Cases: decode and tree verify (chains of D = 8 and 16 nodes) at batch 1, 4, 16 and 64, contexts
drawn from 300-700 keys. The two must agree before either is timed. Each call builds its own
layout (a step builds it once for all its layers), so both times include the same few index
kernels and the ratio understates the kernel's own difference.

    python bench/bench_attention_split.py [--json reports/bench_attention_split.json]
    TRITON_INTERPRET=1 python bench/bench_attention_split.py --device cpu --quick   # agreement only
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_ms, make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.kernels.triton import interpreting  # noqa: E402
from ngram_hal_conformance.test_attention import attention_call  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

WIDTH = 2048


def call_args(batch: int, tree_size: int, device, dtype, seed: int, width: int, contexts: tuple[int, int]) -> dict:
    """One layer's attention call: ``batch`` requests of ``tree_size`` queries (1: decode; more: a
    chain tree), keys bounded by ``width``."""
    rng = random.Random(seed)
    kv_lens = [rng.randint(*contexts) for _ in range(batch)]
    trees = None if tree_size == 1 else [[-1] + list(range(tree_size - 1))] * batch
    call = attention_call(rng, device, dtype, kv_lens=kv_lens, q_lens=[tree_size] * batch, heads=(9, 3),
                          head_dim=64, trees=trees, extra_cols=width - max(kv_lens))
    return {**call.args, "max_kv_len": width}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--tree-sizes", default="1,8,16", metavar="D,...",
                        help="tree sizes: queries per request (1: decode)")
    parser.add_argument("--calls", type=int, default=30, help="calls per captured graph (a step's layers)")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--quick", action="store_true", help="small shapes, agreement only")
    parser.add_argument("--json", default="reports/bench_attention_split.json")
    args = parser.parse_args(argv)
    even = CudaBackend(device=args.device)
    bound = CudaBackend(device=args.device)
    bound.launch = replace(even.launch, attn_even_split=False)
    dtype = torch.float32 if interpreting() else torch.bfloat16
    width, contexts = (64, (5, 20)) if args.quick else (WIDTH, (300, 700))
    batches = [2] if args.quick else [int(b) for b in args.batches.split(",")]
    console = make_console()
    table = make_table(f"attention, keys bounded by {width}, contexts {contexts[0]}-{contexts[1]}: "
                       "graph-replayed us per call", ["case", "even", "bound", "bound / even"], left=["case"])
    results = []
    for batch in batches:
        for tree_size in [int(n) for n in args.tree_sizes.split(",")]:
            a = call_args(batch, tree_size, even.device, dtype, batch * 100 + tree_size, width, contexts)
            case = f"{'decode' if tree_size == 1 else f'tree D={tree_size}'} B={batch}"
            got = {name: backend.attention(**a) for name, backend in (("even", even), ("bound", bound))}
            err = (got["even"].float() - got["bound"].float()).abs().max().item()
            if err > 0.02:
                raise SystemExit(f"{case}: the two settings differ by {err:.3g}")
            us = {}
            for name, backend in (("even", even), ("bound", bound)):
                ms = None if args.quick else graph_ms(lambda b=backend: b.attention(**a), even.device, args.calls,
                                                      args.replays)
                us[name] = None if ms is None else 1e3 * ms
            ratio = None if us["even"] is None else us["bound"] / us["even"]
            results.append({"case": case, "batch": batch, "tree_size": tree_size, "even_us": us["even"],
                            "bound_us": us["bound"], "bound_over_even": ratio, "max_abs_diff": err})
            table.add_row(case, *("-" if us[n] is None else f"{us[n]:.2f}" for n in ("even", "bound")),
                          "-" if ratio is None else f"{ratio:.2f}x")
    console.print(table)
    report = {**report_header("ngram-hal/bench-attention-split/2", even), "width": width,
              "contexts": list(contexts), "dtype": str(dtype).removeprefix("torch."), "results": results}
    write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

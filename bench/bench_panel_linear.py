"""Every projection of SmolLM2-135M for M rows: the model's code panels, float32 panels and F.linear, side by side.

One "step" multiplies M rows by all 121 weight matrices of the model (30 layers of QKV, output,
gate-up and down projections, and the tied LM head; the LM head is left out for the prefill-sized
M, as the engine computes logits only for the last prompt token). Three sides, the same weights
from the GGUF file and the same inputs, alternating, in one process: the layers the cpu backend
gives the model (QuantPanelLinear, the file's Q4_1 and Q8_0 codes), PanelLinear over the
dequantized float32 weights, and F.linear over them. Reports the median step time of each and the
ratios.

    python bench/bench_panel_linear.py [--threads 1] [--rows 1 2 4 8 16 32 64] [--kernel-rows N] [--json PATH]

``--kernel-rows`` moves the row count past which both panel sides go to BLAS (``0``: BLAS for
every count, a large value: the kernel for every count), to time one against the other.
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

from ngram_hal.kernels.cpu import PanelLinear  # noqa: E402
from ngram_hal.model_kernels import DenseLinear  # noqa: E402
from ngram_hal.engine.model import LlamaModel  # noqa: E402
from ngram_hal.registry import get_backend  # noqa: E402


def step_layers(model: LlamaModel) -> list:
    return [lin for layer in model.layers for lin in (layer.wqkv, layer.wo, layer.w_gate_up, layer.w_down)]


def run_step(layers, head, xs: dict[int, torch.Tensor]) -> None:
    for lin in layers:
        lin(xs[lin.in_features])
    if head is not None:
        head(xs[head.in_features])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--prefill-rows", type=int, default=444)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--kernel-rows", type=int, default=None,
                    help="the most rows the compiled kernel takes before BLAS (default: the layers' own)")
    ap.add_argument("--json", default="reports/bench_panel_linear.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = LlamaModel.from_gguf(get_backend("cpu"))
    sides = {"codes": step_layers(model)}
    sides["panels"] = [PanelLinear(lin.dense()) for lin in sides["codes"]]
    sides["dense"] = [DenseLinear(lin.dense()) for lin in sides["codes"]]
    heads = {"codes": model.lm_head, "panels": PanelLinear(model.lm_head.dense()),
             "dense": DenseLinear(model.lm_head.dense())}
    if args.kernel_rows is not None:
        for lin in [*sides["codes"], *sides["panels"], heads["codes"], heads["panels"]]:
            lin.kernel_rows = args.kernel_rows
    console = make_console()
    kernel_rows = sides["codes"][0].kernel_rows
    table = make_table(f"Projections of one SmolLM2-135M step, float32, {torch.get_num_threads()} thread(s), "
                       f"the kernel up to {kernel_rows} rows",
                       ("rows", "codes ms", "float panels ms", "F.linear ms", "panels / codes", "F.linear / codes"))
    results = []
    cases = [(m, True) for m in args.rows] + [(args.prefill_rows, False)]
    for rows, with_head in cases:
        gen = torch.Generator().manual_seed(rows)
        xs = {k: torch.randn(rows, k, generator=gen) for k in {lin.in_features for lin in sides["codes"]}}
        times = {name: [] for name in sides}
        repeats = args.repeats if with_head else 3
        for name, layers in sides.items():
            run_step(layers, heads[name] if with_head else None, xs)
        for _ in range(repeats):
            for name, layers in sides.items():
                start = time.perf_counter()
                run_step(layers, heads[name] if with_head else None, xs)
                times[name].append(time.perf_counter() - start)
        c, p, d = (statistics.median(times[name]) * 1e3 for name in ("codes", "panels", "dense"))
        label = str(rows) if with_head else f"{rows} (prefill, no LM head)"
        table.add_row(label, f"{c:.1f}", f"{p:.1f}", f"{d:.1f}", f"{p / c:.2f}x", f"{d / c:.2f}x")
        results.append({"rows": rows, "lm_head": with_head, "codes_ms": c, "panel_ms": p, "f_linear_ms": d,
                        "panels_over_codes": p / c, "f_linear_over_codes": d / c})
    console.print(table)
    write_report(args.json, {**report_header("bench_panel_linear", model.backend), "kernel_rows": kernel_rows,
                             "results": results}, console)


if __name__ == "__main__":
    main()

"""A layer's projections fused with their norms, SwiGLU and residual adds, against the steps apart.

One decoder layer's four products run two ways on the same inputs:

- **apart**: the RMSNorm kernel (with the residual add), cuBLAS (``F.linear``) for QKV, the output
  projection, the second norm, gate/up, the SwiGLU kernel, down: seven launches;
- **fused**: :func:`ngram_hal.kernels.gpu.matmul.fused_linear` four times (norm + QKV, output
  projection + residual add, norm + gate/up + SwiGLU, down + residual add; the norms' weights
  folded into the projections): four launches, in the engine's tiling (``SMALL_ROWS``) or in
  fixed tilings (``--sweep``);
- the batch-invariant mode before and after fusing: the steps apart with the invariant product,
  and fused in the invariant tiling (today the same tiling as ``fused``).

The two must agree before either is timed. Times are device time per layer from a CUDA graph of
``--layers`` layers (as a captured decode step replays them), each with weights of its own where
they fit (at least 160 MB of weights in all: more than the L2 cache, as in a model's forward). Shapes: SmolLM2-135M (hidden 576,
9/3 heads of 64, MLP 1536) and Llama-3-8B (4096, 32/8 heads of 128, MLP 14336).

    python bench/bench_fused_linear.py [--rows 1,16,64] [--sweep] [--json reports/bench_fused_linear.json]
    TRITON_INTERPRET=1 python bench/bench_fused_linear.py --device cpu --quick   # agreement only
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_ms, make_console, make_table, report_header, write_report  # noqa: E402

from ngram_hal.kernels.gpu.matmul import INVARIANT, SMALL_ROWS, Tiling, fold_norm, fused_linear, invariant_linear  # noqa: E402
from ngram_hal.kernels.gpu.norm import rms_norm  # noqa: E402
from ngram_hal.kernels.gpu.swiglu import swiglu  # noqa: E402
from ngram_hal.kernels.triton import interpreting  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

MODELS = {"SmolLM2-135M": (576, 9, 3, 64, 1536), "Llama-3-8B": (4096, 32, 8, 128, 14336)}
QUICK_MODELS = {"tiny": (64, 2, 1, 32, 96)}
SWEEP = (Tiling(16, 16, 64), Tiling(16, 16, 128), Tiling(16, 16, 256), Tiling(16, 32, 64), Tiling(16, 32, 128),
         Tiling(16, 32, 256), Tiling(16, 64, 128))
WEIGHT_BYTES = 160e6
EPS = 1e-5


class Weights:
    """One layer's weights, bf16 (float32 under the interpreter), random on the device."""

    def __init__(self, shape, device: torch.device, dtype: torch.dtype, seed: int):
        hidden, hq, h, d, inter = shape
        gen = torch.Generator(device).manual_seed(seed)

        def randn(*size, scale=0.02):
            return (scale * torch.randn(size, generator=gen, device=device)).to(dtype)

        self.wqkv, self.wo = randn((hq + 2 * h) * d, hidden), randn(hidden, hq * d)
        self.wgu, self.wdown = randn(2 * inter, hidden), randn(hidden, inter)
        self.g1, self.g2 = 1 + randn(hidden, scale=0.1), 1 + randn(hidden, scale=0.1)
        self.wqkv_g, self.wgu_g = fold_norm(self.wqkv, self.g1), fold_norm(self.wgu, self.g2)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.wqkv, self.wo, self.wgu, self.wdown))


class Layer:
    """A step's activations and the weights of its layers: each call runs the next layer's."""

    def __init__(self, shape, rows: int, device: torch.device, dtype: torch.dtype, layers: int):
        hidden, hq = shape[0], shape[1] * shape[3]
        first = Weights(shape, device, dtype, 0)
        distinct = max(1, min(layers, math.ceil(WEIGHT_BYTES / first.nbytes)))
        self.weights = [first] + [Weights(shape, device, dtype, i) for i in range(1, distinct)]
        self.calls = 0
        gen = torch.Generator(device).manual_seed(rows)
        self.x0 = torch.randn((rows, hidden), generator=gen, device=device).to(dtype)
        self.o = torch.randn((rows, hq), generator=gen, device=device).to(dtype)
        self.x = self.x0.clone()

    def _next(self) -> Weights:
        """The weights of the next layer (the layers cycle)."""
        w = self.weights[self.calls % len(self.weights)]
        self.calls += 1
        return w

    def apart(self, product=F.linear):
        w = self._next()
        qkv = product(rms_norm(self.x, w.g1, EPS), w.wqkv)
        h = rms_norm(self.x, w.g2, EPS, product(self.o, w.wo))
        act = swiglu(product(h, w.wgu))
        self.x.add_(product(act, w.wdown))
        return qkv, act

    def fused(self, tiling=SMALL_ROWS):
        w = self._next()
        qkv = fused_linear(self.x, w.wqkv_g, norm_eps=EPS, tiling=tiling)
        fused_linear(self.o, w.wo, residual=self.x, tiling=tiling)
        h = fused_linear(self.x, w.wgu_g, norm_eps=EPS, glu=True, tiling=tiling)
        fused_linear(h, w.wdown, residual=self.x, tiling=tiling)
        return qkv, h

    def result(self, run):
        self.x.copy_(self.x0)
        self.calls = 0
        qkv, act = run()
        return torch.cat([qkv.float().flatten(), act.float().flatten(), self.x.float().flatten()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", default="1,4,16,64")
    parser.add_argument("--layers", type=int, default=30, help="layers per captured graph")
    parser.add_argument("--replays", type=int, default=50)
    parser.add_argument("--sweep", action="store_true", help="also time fixed tilings")
    parser.add_argument("--quick", action="store_true", help="a tiny shape, agreement only")
    parser.add_argument("--json", default="reports/bench_fused_linear.json")
    args = parser.parse_args(argv)
    backend = CudaBackend(device=args.device)
    device = backend.device
    dtype = torch.float32 if interpreting() else torch.bfloat16
    models = QUICK_MODELS if args.quick else MODELS
    rows_list = [int(r) for r in args.rows.split(",")]
    console = make_console()
    table = make_table("one layer's projections: us of device time per layer (graph)",
                       ["model", "rows", "variant", "launches", "us/layer", "vs apart"], left=["model", "variant"])
    results = []
    for model, shape in models.items():
        for rows in rows_list:
            layer = Layer(shape, rows, device, dtype, args.layers)
            variants = {"apart (cuBLAS)": (layer.apart, 7), "fused": (layer.fused, 4),
                        "invariant apart": (lambda: layer.apart(invariant_linear), 7),
                        "invariant fused": (lambda: layer.fused(INVARIANT), 4)}
            if args.sweep:
                variants.update({f"fused {t.block_m}x{t.block_n}x{t.block_k}": (lambda t=t: layer.fused(t), 4)
                                 for t in SWEEP})
            want = layer.result(layer.apart)
            distinct = len(layer.weights)
            base = None
            for name, (run, launches) in variants.items():
                got = layer.result(run)
                err = ((got - want).abs().max() / want.abs().max()).item()
                if err > 0.05:
                    raise SystemExit(f"{model} rows={rows} {name}: differs from the steps apart by {err:.3g} "
                                     "of the largest value")
                layer.x.copy_(layer.x0)
                ms = None if args.quick else graph_ms(run, device, args.layers, args.replays)
                us = None if ms is None else 1e3 * ms
                base = us if name == "apart (cuBLAS)" else base
                ratio = None if us is None or base is None else base / us
                results.append({"model": model, "rows": rows, "variant": name, "launches": launches,
                                "distinct_layers": distinct,
                                "us_per_layer": us, "speedup_vs_apart": ratio, "max_rel_diff": err})
                table.add_row(model, str(rows), name, str(launches), "-" if us is None else f"{us:.2f}",
                              "-" if ratio is None else f"{ratio:.2f}x")
    console.print(table)
    report = {**report_header("ngram-hal/bench-fused-linear/1", backend), "layers_per_graph": args.layers,
              "dtype": str(dtype).removeprefix("torch."), "results": results}
    write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

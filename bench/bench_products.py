"""The model's projections at real shapes: every candidate product timed, the fastest written as the
backend's product table.

For each shape (``--shapes``: presets of :data:`ngram_hal.engine.shapes.PRESETS` or JSON files) the
five products of a decode step (QKV after the attention norm, with the rotary embedding and the K/V
store after it, the output projection and its residual add, gate/up after the MLP norm with SwiGLU,
down and its residual add, the LM head) run through the engine's own Triton model kernels at each
row count of ``--rows``, once per candidate: the steps apart (the norm kernel, cuBLAS, the rotary or
the SwiGLU kernel) and the fused product in each tiling of :data:`SWEEP` (those that split K up to
64 rows). A candidate must agree with the steps apart before it is timed. Time is device time per
call from a CUDA graph that cycles through copies of the weight (at least 256 MB of them, more than
the L2 cache, as a model's layers are), reported with the bandwidth of weight bytes it reaches
against a device-to-device copy measured in the same run.

``--write-table PATH`` writes the choice per weight shape
(:mod:`ngram_hal.kernels.triton.products`), keeping the shapes a table already there holds and this
run did not sweep: the fastest candidate at each row count (the steps apart included), and the
batch-invariant mode's runs of K (:meth:`~ngram_hal.kernels.triton.products.Tiling.k_split`: all of
K, or the runs of a split) with, at each row count, the fastest fused tiling of those runs. Each
candidate's rows are compared with those of the first tiling of its runs on the most rows; where
every tiling of the runs gave every row the same bits the mode takes the fastest per row count,
else the runs' one tiling with the least time summed over the row counts, each relative to that
count's fastest. Of the runs timed at every row count the table keeps those that sum least so.
The cuda backend runs by the table of its GPU model (``ngram_hal_cuda/products/``);
``bench/bench_shapes.py --products table,fixed`` runs the engine by it beside the fixed rule.
``--products`` and ``--tilings`` restrict a sweep; ``--jobs N`` first compiles its kernels in N
processes at once (a cold Triton cache otherwise compiles some hundred kernels one at a time).

    python bench/bench_products.py --shapes smollm2-135m,llama-1b,llama-8b --jobs 8 \\
        --write-table backends/cuda/ngram_hal_cuda/products/h200.json --json reports/bench_products.json
    TRITON_INTERPRET=1 NGRAM_HAL_CUDA_PROXY=1 python bench/bench_products.py --device cpu --shapes tiny.json --rows 1,3
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import graph_ms, make_console, make_table, name_list, report_header, write_report  # noqa: E402

from ngram_hal.options import int_list  # noqa: E402
from ngram_hal.engine.shapes import load_shape  # noqa: E402
from ngram_hal.kernels.gpu.layer_kernels import TritonLayerKernels, TritonLinear  # noqa: E402
from ngram_hal.kernels.triton import interpreting  # noqa: E402
from ngram_hal.kernels.triton.products import ProductTable, RowsChoice, ShapeChoice, Tiling  # noqa: E402
from ngram_hal.kv_cache import KVCache  # noqa: E402
from ngram_hal.model_kernels import default_dtype  # noqa: E402
from ngram_hal.options import POSITIVE_INT  # noqa: E402
from ngram_hal_cuda import CudaBackend  # noqa: E402

SWEEP = (Tiling(16, 32, 256), Tiling(16, 16, 256), Tiling(16, 16, 512), Tiling(16, 32, 128), Tiling(16, 32, 512),
         Tiling(16, 64, 128), Tiling(16, 64, 256), Tiling(16, 32, 256, 4, 4), Tiling(16, 32, 256, 8, 3),
         Tiling(16, 64, 128, 4, 4), Tiling(16, 128, 128, 8, 3), Tiling(32, 64, 128), Tiling(64, 64, 64),
         Tiling(64, 128, 64, 8, 3), Tiling(128, 64, 64, 4, 3), Tiling(128, 128, 64, 8, 3),
         Tiling(16, 32, 256, 4, 3, 2), Tiling(16, 32, 256, 4, 3, 4), Tiling(16, 32, 256, 4, 3, 8),
         Tiling(16, 32, 128, 4, 4, 4), Tiling(16, 16, 256, 4, 3, 4), Tiling(16, 64, 128, 4, 4, 2),
         Tiling(16, 64, 128, 4, 4, 4),
         Tiling(16, 32, 64, 4, 9), Tiling(16, 64, 64, 4, 9), Tiling(32, 64, 64, 4, 9), Tiling(64, 64, 64, 4, 6),
         Tiling(16, 64, 128, 4, 5), Tiling(32, 64, 128, 4, 5), Tiling(16, 16, 256, 4, 8), Tiling(16, 32, 256, 4, 6))
"""Candidate tilings; the first is the engine's fixed :data:`~ngram_hal.kernels.gpu.matmul.SMALL_ROWS`. Those
that split K are timed up to :data:`SPLIT_MAX_ROWS` rows: past that they lost to one walk over K at
SmolLM2's shapes on an H100 (the down projection at 1,088 rows: 18.1 us in four runs of 384, 15.5 in two
of 768, 10.5 in one), so the batch-invariant mode keeps a split's runs only for shapes swept at few rows.
The last eight pipeline deep: with 5-9 stages a program has most or all of a short reduction's loads
(SmolLM2's K of 576 is nine steps of 64) in flight at once, as the vendor BLAS's kernels for these shapes do
(16 stages of 64), where 3-4 stages wait on memory several times a walk. A tiling whose stages do not fit a
program's shared memory on the device is skipped there."""
SPLIT_MAX_ROWS = 64
QUICK_SWEEP = (Tiling(16, 32, 256), Tiling(16, 16, 64), Tiling(16, 16, 64, split_k=2))
WEIGHT_BYTES = 256 << 20
AGREE = 0.05


PRODUCTS = ("qkv", "o", "gate_up", "down", "lm_head")


def projections(config) -> dict[str, tuple[int, int]]:
    """Weight shape ``[N, K]`` of each product of a layer and of the LM head."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hd, inter = config.hidden_size, config.intermediate_size
    return dict(zip(PRODUCTS, ((q + 2 * kv, hd), (hd, q), (2 * inter, hd), (hd, inter), (config.vocab_size, hd))))


class Step:
    """What a layer's QKV step writes besides its output: one layer's K/V cache of ``rows`` slots,
    every row's position and slot its own index."""

    def __init__(self, config, rows: int, dtype: torch.dtype, device: torch.device):
        self.kv = KVCache(1, rows, config.num_kv_heads, config.head_dim, dtype, device)
        self.index = torch.arange(rows, dtype=torch.int64, device=device)


def call(kind: str, kernels: TritonLayerKernels, linear: TritonLinear, x: torch.Tensor, residual: torch.Tensor,
         step: Step):
    """One product as the model runs it: float[rows, K] in; the output (for QKV the rotated
    queries, K/V stored into ``step``'s cache), or None where the residual add was done in place."""
    if kind == "qkv":
        rows = step.index[:x.shape[0]]
        return kernels.norm_rope_store(x, None, linear, rows, step.kv, 0, rows)
    if kind == "gate_up":
        return kernels.norm_swiglu(x, None, linear)
    if kind == "lm_head":
        return linear(x)
    return kernels.linear_add(x, linear, residual)


def swept(args) -> tuple[Tiling, ...]:
    """The tilings a run sweeps: :data:`SWEEP` (:data:`QUICK_SWEEP` with ``--quick``), those of
    ``--tilings`` only where it is given."""
    sweep = QUICK_SWEEP if args.quick else SWEEP
    return tuple(t for t in sweep if not args.tilings or t.label in args.tilings)


def candidates(kind: str, sweep: tuple[Tiling, ...]) -> tuple[Tiling, ...]:
    """The fused tilings timed for a product: ``sweep``, and for QKV also each unsplit one with the
    rotary kernel after it (``rotate`` False) as well as the rotation in its epilogue."""
    if kind != "qkv":
        return sweep
    return sweep + tuple(t._replace(rotate=False) for t in sweep if t.split_k == 1)


def forced(kernels: TritonLayerKernels, base, weight_shape: tuple[int, int], rows: int, tiling: Tiling | None):
    """``kernels`` set to run ``tiling`` (None: the steps apart) for weights of ``weight_shape``."""
    choice = ShapeChoice(n=weight_shape[0], k=weight_shape[1], by_rows=(RowsChoice(max_rows=rows, tiling=tiling),),
                         invariant=SWEEP[0])
    table = ProductTable(device="sweep", dtype="-", source="-", shapes=(choice,))
    kernels.launch = dataclasses.replace(base, products=table)


def output(kind, kernels, linear, x, step: Step) -> torch.Tensor:
    """The product's result on ``x`` (a residual add's increment on a zero residual), float32."""
    residual = torch.zeros((x.shape[0], linear.weight.shape[0]), dtype=x.dtype, device=x.device)
    out = call(kind, kernels, linear, x, residual, step)
    return (residual if out is None else out).float()


def time_shape(name: str, config, args, backend, dtype, console, skipped: list[dict]) -> list[dict]:
    """Rows of one shape: every product, row count and candidate; the candidates that do not fit
    the device (shared memory) are added to ``skipped`` instead."""
    kernels = TritonLayerKernels(config, backend, dtype)
    base = backend.launch
    sweep = swept(args)
    gen = torch.Generator(backend.device).manual_seed(args.seed)
    rows_out = []
    for kind, (n, k) in projections(config).items():
        if args.products and kind not in args.products:
            continue
        weight_bytes = n * k * dtype.itemsize
        copies = max(1, min(args.max_copies, math.ceil(WEIGHT_BYTES / weight_bytes)))
        copies = copies if backend.device.type == "cuda" else 1
        linears = [TritonLinear((0.02 * torch.randn((n, k), generator=gen, device=backend.device)).to(dtype), kernels)
                   for _ in range(copies)]
        out_n = n // 2 if kind == "gate_up" else n
        x_all = torch.randn((max(args.rows), k), generator=gen, device=backend.device).to(dtype)
        step = Step(config, max(args.rows), dtype, backend.device)
        # Every fused candidate's rows are compared with those of the first tiling of its runs of K
        # on the most rows.
        references = {}

        def reference(tiling: Tiling) -> torch.Tensor:
            run = tiling.k_split(k)
            if run not in references:
                forced(kernels, base, (n, k), max(args.rows), tiling)
                references[run] = output(kind, kernels, linears[0], x_all, step)
            return references[run]

        for rows in args.rows:
            x = x_all[:rows]
            residual = torch.zeros((rows, out_n), dtype=dtype, device=backend.device)
            forced(kernels, base, (n, k), rows, None)
            want = output(kind, kernels, linears[0], x, step)
            apart_us = None
            for tiling in (None, *(t for t in candidates(kind, sweep) if t.split_k == 1 or rows <= SPLIT_MAX_ROWS)):
                try:
                    same = None if tiling is None else reference(tiling)[:rows]
                    forced(kernels, base, (n, k), rows, tiling)
                    got = output(kind, kernels, linears[0], x, step)
                except OutOfResources as exc:
                    skipped.append({"shape": name, "product": kind, "rows": rows, "tiling": list(tiling),
                                    "reason": str(exc)})
                    continue
                err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
                if err > AGREE:
                    raise SystemExit(f"{name} {kind} rows={rows} {tiling}: differs from the steps apart by {err:.3g} "
                                     "of the largest value")
                same_bits = None if tiling is None else torch.equal(got, same)
                turn = iter(range(1 << 62))
                ms = graph_ms(lambda: call(kind, kernels, linears[next(turn) % copies], x, residual, step),
                              backend.device, copies, args.replays)
                us = None if ms is None else 1e3 * ms
                apart_us = us if tiling is None else apart_us
                rows_out.append({"shape": name, "product": kind, "n": n, "k": k, "rows": rows,
                                 "candidate": "apart" if tiling is None else tiling.label,
                                 "tiling": None if tiling is None else list(tiling), "us": us,
                                 "weight_gb_per_s": None if us is None else weight_bytes / us / 1e3,
                                 "vs_apart": None if us is None or apart_us is None else apart_us / us,
                                 "max_rel_diff": err, "same_bits": same_bits, "weight_copies": copies})
        console.print(f"{name} {kind} [{n}, {k}]: {len(args.rows)} row counts x {1 + len(candidates(kind, sweep))} "
                      "candidates")
        del linears
    kernels.launch = base
    return rows_out


def run_option(run_rows: dict[int, list[dict]], best: dict[int, dict]) -> tuple | None:
    """What the batch-invariant mode would get of one run of K (``run_rows``: its tilings' results per
    row count): ``(cost, tiling, agree, fastest)``, the time summed over the row counts, each relative
    to ``best`` there; the one tiling with the least such sum; whether every tiling gave the same bits;
    and the fastest result per row count. Where they agree the cost is the fastest tilings' (the mode
    changes tiling by row count), else the one tiling's. None where the run misses a row count, or
    its tilings disagree and none of them was timed at every row count."""
    if run_rows.keys() != best.keys():
        return None
    fastest = {rows: min(cands, key=lambda r: r["us"]) for rows, cands in run_rows.items()}
    relative = {}
    for rows, cands in run_rows.items():
        for r in cands:
            relative.setdefault(tuple(r["tiling"]), []).append(r["us"] / best[rows]["us"])
    every_row = {t: sum(v) for t, v in relative.items() if len(v) == len(best)}
    agree = all(r["same_bits"] for cands in run_rows.values() for r in cands)
    if agree:
        one = min(every_row, key=every_row.get) if every_row else tuple(fastest[max(best)]["tiling"])
        return sum(fastest[rows]["us"] / best[rows]["us"] for rows in best), one, True, fastest
    if not every_row:
        return None
    one = min(every_row, key=every_row.get)
    return every_row[one], one, False, fastest


def choose_table(results: list[dict], device_name: str, dtype: torch.dtype, source: str) -> ProductTable:
    """The fastest candidate per weight shape and row count, and the batch-invariant mode's runs of K:
    of the runs' :func:`run_option`, the least cost (one walk over all of K wins a tie), its tiling
    the shape's ``invariant`` and its fastest per row count each bucket's ``fused``."""
    shapes = {}
    for r in results:
        shapes.setdefault((r["n"], r["k"]), {}).setdefault(r["rows"], []).append(r)
    choices = []
    for (n, k), by_rows in shapes.items():
        best = {rows: min(cands, key=lambda r: r["us"]) for rows, cands in sorted(by_rows.items())}
        runs = {}
        for rows, cands in by_rows.items():
            for r in cands:
                if r["tiling"] is not None:
                    runs.setdefault(Tiling(*r["tiling"]).k_split(k), {}).setdefault(rows, []).append(r)
        options = {run: run_option(run_rows, best) for run, run_rows in runs.items()}
        run = min((run for run, o in options.items() if o is not None), key=lambda run: (options[run][0], run != k))
        _, invariant, agree, fastest = options[run]
        choices.append(ShapeChoice(n=n, k=k, invariant=Tiling(*invariant), tilings_agree=agree, by_rows=tuple(
            RowsChoice(max_rows=rows, tiling=None if r["tiling"] is None else Tiling(*r["tiling"]),
                       fused=Tiling(*fastest[rows]["tiling"]))
            for rows, r in best.items())))
    return ProductTable(device=device_name, dtype=str(dtype).removeprefix("torch."), source=source,
                        shapes=tuple(choices))


def keep_others(old: ProductTable, new: ProductTable) -> ProductTable:
    """``new`` with the shapes of ``old`` (a table of the same device and dtype) that ``new`` did
    not sweep, and both sources."""
    if (old.device, old.dtype) != (new.device, new.dtype):
        raise SystemExit(f"--write-table: the file holds a table for {old.device} {old.dtype}, "
                         f"this sweep ran on {new.device} {new.dtype}")
    new_shapes = {(c.n, c.k) for c in new.shapes}
    kept = tuple(c for c in old.shapes if (c.n, c.k) not in new_shapes)
    source = new.source if not kept else f"{new.source}; other shapes: {old.source}"
    return ProductTable(device=new.device, dtype=new.dtype, source=source, shapes=kept + new.shapes)


def specialisations(rows: list[int]) -> list[int]:
    """One row count of ``rows`` for each kind Triton compiles a kernel apart for: 1, a multiple of
    16, any other."""
    kinds = {}
    for r in rows:
        kinds.setdefault(1 if r == 1 else 16 if r % 16 == 0 else 0, r)
    return sorted(kinds.values())


def precompile(args) -> dict:
    """Compile the sweep's kernels in ``args.jobs`` processes at once, before it is timed: each process
    runs this script on one product and a share of the tilings, at one row count of each
    specialisation and one replay, so that the sweep finds every kernel in Triton's cache (on a cold
    cache one process compiles them one at a time: minutes). What it did, for the report."""
    tilings = [t.label for t in swept(args)]
    products = args.products or list(PRODUCTS)
    per_task = max(1, math.ceil(len(tilings) * len(products) / (2 * args.jobs)))
    tasks = [(p, tilings[i:i + per_task]) for p in products for i in range(0, len(tilings), per_task)]
    rows = ",".join(map(str, specialisations(args.rows)))

    def compile_share(task: tuple[str, list[str]]) -> None:
        product, share = task
        with tempfile.TemporaryDirectory() as tmp:
            done = subprocess.run([sys.executable, __file__, "--device", args.device, "--shapes", args.shapes,
                                   "--rows", rows, "--replays", "1", "--max-copies", "1", "--products", product,
                                   "--tilings", ",".join(share), "--json", str(Path(tmp) / "report.json")]
                                  + (["--quick"] if args.quick else []), capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"--jobs: compiling {product} in {','.join(share)} failed:\n{done.stderr[-2000:]}")

    start = time.perf_counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(compile_share, tasks))
    return {"jobs": args.jobs, "processes": len(tasks), "rows": rows, "seconds": time.perf_counter() - start}


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="smollm2-135m,llama-1b,llama-8b")
    parser.add_argument("--rows", type=int_list, default=[1, 8, 16, 64], help="rows per product (increasing)")
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--max-copies", type=int, default=256, help="most copies of a weight a graph cycles through")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="three candidate tilings only")
    parser.add_argument("--products", type=name_list, default=None,
                        help=f"these products only (of {', '.join(PRODUCTS)}; default: all)")
    parser.add_argument("--tilings", type=name_list, default=None, metavar="LABEL,...",
                        help="these candidate tilings only, by label (16x32x256, 64x64x64/s6/k4, ...)")
    parser.add_argument("--jobs", type=POSITIVE_INT, default=1, metavar="N",
                        help="compile the candidates in N processes at once before timing them (default 1: "
                             "as they are timed)")
    parser.add_argument("--write-table", help="write the chosen products here (a product table JSON)")
    parser.add_argument("--json", default="reports/bench_products.json")
    args = parser.parse_args(argv)
    if args.rows != sorted(set(args.rows)):
        parser.error(f"--rows must increase, got {args.rows}")
    if args.products and not set(args.products) <= set(PRODUCTS):
        parser.error(f"--products: {', '.join(sorted(set(args.products) - set(PRODUCTS)))} not among "
                     f"{', '.join(PRODUCTS)}")
    labels = {t.label for t in SWEEP + QUICK_SWEEP}
    if args.tilings and not set(args.tilings) <= labels:
        parser.error(f"--tilings: no candidate {', '.join(sorted(set(args.tilings) - labels))}")
    backend = CudaBackend(device=args.device)
    device = backend.device
    if args.write_table and device.type != "cuda":
        raise SystemExit("--write-table needs timings: run on a CUDA device")
    dtype = torch.float32 if interpreting() else default_dtype(device)
    console = make_console()
    compiled = precompile(args) if args.jobs > 1 else None
    if compiled:
        console.print(f"{compiled['processes']} processes, {args.jobs} at a time, compiled the candidates at "
                      f"{compiled['rows']} rows in {compiled['seconds']:.0f} s")
    bandwidth = None if device.type == "cpu" else backend.runtime.copy_bandwidth(1 << 30)
    results, skipped = [], []
    for spec in args.shapes.split(","):
        name, config = load_shape(spec)
        results += time_shape(name, config, args, backend, dtype, console, skipped)
    if skipped:
        console.print(f"{len(skipped)} candidate calls skipped: their stages do not fit the device's shared memory "
                      f"({', '.join(sorted({Tiling(*s['tiling']).label for s in skipped}))})")
    table = make_table("the model's products: us of device time per call (graph), weight GB/s",
                       ["shape", "product", "rows", "apart us", "best", "best us", "GB/s", "of copy bw", "vs apart"],
                       left=["shape", "product", "best"])
    groups = {}
    for r in results:
        groups.setdefault((r["shape"], r["product"], r["rows"]), []).append(r)
    for (shape, product, rows), cands in groups.items():
        best = min(cands, key=lambda r: r["us"] if r["us"] is not None else 0.0)
        apart = cands[0]
        of_copy = None if bandwidth is None or best["us"] is None else best["weight_gb_per_s"] * 1e9 / bandwidth
        table.add_row(shape, product, str(rows), _fmt(apart["us"], "{:.1f}"), best["candidate"],
                      _fmt(best["us"], "{:.1f}"), _fmt(best["weight_gb_per_s"], "{:.0f}"), _fmt(of_copy, "{:.0%}"),
                      _fmt(best["vs_apart"], "{:.2f}x"))
    console.print(table)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreted)"
    only = "".join(f" --{name} {','.join(v)}" for name, v in (("products", args.products), ("tilings", args.tilings))
                   if v)
    rows = ",".join(map(str, args.rows))
    source = f"bench/bench_products.py --shapes {args.shapes} --rows {rows}{only} at {commit()}"
    report = {**report_header("ngram-hal/bench-products/1", backend), "dtype": str(dtype).removeprefix("torch."),
              "copy_bandwidth_bytes_per_s": bandwidth, "precompiled": compiled, "results": results,
              "skipped": skipped}
    if args.write_table:
        chosen = choose_table(results, device_name, dtype, source)
        if Path(args.write_table).exists():
            chosen = keep_others(ProductTable.load(args.write_table), chosen)
        Path(args.write_table).parent.mkdir(parents=True, exist_ok=True)
        chosen.dump(args.write_table)
        report["table"] = chosen.model_dump(mode="json", by_alias=True)
        console.print(f"product table for {device_name} written to {args.write_table}")
    write_report(args.json, report, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

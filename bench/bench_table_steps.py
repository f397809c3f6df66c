"""What product tables make of a decode step's products: each table's choices priced by one sweep.

Reads a report of ``bench/bench_products.py`` (every candidate product timed per shape and row
count) and one or more product tables, and gives for each shape, row count and mode the time of a
step's products as each table chooses them: the layers' four products times the layer count, plus
the LM head (those of them the sweep timed: a sweep of QKV alone prices QKV's share of a step),
each at the device time the sweep measured for that choice (the default mode:
:func:`~ngram_hal.kernels.triton.products.choose`, the steps apart where it says None; the
batch-invariant mode: :func:`~ngram_hal.kernels.triton.products.choose_invariant`). A sum of
products timed one at a time, with the weights cycled out of L2: not a step's time (attention, the
norms between and the launches are left out), but the part of it that the tables change, every
table priced by the same measurements. A choice the sweep did not time is reported as missing.
Runs on the CPU.

    python bench/bench_table_steps.py --products docs/bench/h200-qkv-rotary/products-smollm2.json \\
        --tables docs/bench/h200-qkv-rotary/table-718f921.json,backends/cuda/ngram_hal_cuda/products/h200.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import make_console, make_table, write_report  # noqa: E402

from ngram_hal.engine.shapes import load_shape  # noqa: E402
from ngram_hal.kernels.triton.products import ProductTable, Tiling, choose, choose_invariant  # noqa: E402

LAYER_PRODUCTS = ("qkv", "o", "gate_up", "down")
MODES = {"default": choose, "invariant": choose_invariant}


def measured(results: list[dict]) -> dict:
    """``{(shape, product, rows, tiling or None): us}`` of a products report's timed candidates."""
    return {(r["shape"], r["product"], r["rows"], None if r["tiling"] is None else Tiling(*r["tiling"])): r["us"]
            for r in results if r["us"] is not None}


def step_products(results: list[dict], table: ProductTable, layers: dict[str, int]) -> list[dict]:
    """One row per shape, row count and mode: each swept product's choice and time by ``table``,
    and their sum over a step (``layers[shape]`` layers and the LM head, where swept; None where a
    choice is missing from the sweep or its shape from the table)."""
    times = measured(results)
    weights, row_counts = {}, {}
    for r in results:
        weights.setdefault(r["shape"], {})[r["product"]] = (r["n"], r["k"])
        row_counts.setdefault(r["shape"], set()).add(r["rows"])
    out = []
    for shape, products in weights.items():
        for rows in sorted(row_counts[shape]):
            for mode, pick in MODES.items():
                chosen = {}
                for product, (n, k) in products.items():
                    choice = table.lookup(n, k)
                    tiling = None if choice is None else pick(choice, rows)
                    us = None if choice is None else times.get((shape, product, rows, tiling))
                    chosen[product] = {"tiling": None if tiling is None else list(tiling), "us": us}
                layer_us = [chosen[p]["us"] for p in LAYER_PRODUCTS if p in chosen]
                head_us = [chosen["lm_head"]["us"]] if "lm_head" in chosen else []
                step_us = None
                if None not in layer_us + head_us:
                    step_us = layers[shape] * sum(layer_us) + sum(head_us)
                out.append({"shape": shape, "rows": rows, "mode": mode, "products": chosen, "step_us": step_us})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--products", required=True, help="a bench_products.py report (JSON)")
    parser.add_argument("--tables", required=True, help="product table files, comma separated (the first: the baseline)")
    parser.add_argument("--json", default="reports/bench_table_steps.json")
    args = parser.parse_args(argv)
    results = json.loads(Path(args.products).read_text())["results"]
    layers = {name: load_shape(name)[1].num_layers for name in {r["shape"] for r in results}}
    paths = args.tables.split(",")
    priced = {path: step_products(results, ProductTable.load(path), layers) for path in paths}
    console = make_console()
    table = make_table("a step's products by each table, us (the sweep's times summed: layers x the swept layer "
                       "products + LM head, where swept)",
                       ["shape", "products", "rows", "mode", *(Path(p).name for p in paths), *(f"{Path(p).name} / first"
                                                                                     for p in paths[1:])],
                       left=["shape", "products", "mode"])
    for i, first in enumerate(priced[paths[0]]):
        sums = [priced[p][i]["step_us"] for p in paths]
        ratios = ["-" if None in (s, sums[0]) else f"{s / sums[0]:.2f}x" for s in sums[1:]]
        table.add_row(first["shape"], ",".join(first["products"]), str(first["rows"]), first["mode"],
                      *("missing" if s is None else f"{s:.1f}" for s in sums), *ratios)
    console.print(table)
    write_report(args.json, {"schema": "ngram-hal/bench-table-steps/1", "products_report": args.products,
                             "layers": layers, "tables": {p: priced[p] for p in paths}}, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())

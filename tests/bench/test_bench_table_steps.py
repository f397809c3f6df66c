"""``bench/bench_table_steps.py``: each table's choices priced by one sweep, on synthetic timings
whose sums are known."""

from __future__ import annotations

import json

from ngram_hal.kernels.triton.products import SCHEMA

A = [16, 16, 64, 4, 3, 1]
SHAPES = {"qkv": (40, 8), "o": (8, 8), "gate_up": (32, 8), "down": (8, 16), "lm_head": (64, 8)}


def _results(shape: str) -> list[dict]:
    """Every product at 1 and 4 rows: apart 10 us (the LM head 20), tiling A 4 us at 1 row and
    8 at 4 (the LM head 15 and 30)."""
    out = []
    for product, (n, k) in SHAPES.items():
        head = product == "lm_head"
        for rows, fused in ((1, 15 if head else 4), (4, 30 if head else 8)):
            out.append({"shape": shape, "product": product, "n": n, "k": k, "rows": rows, "tiling": None,
                        "us": 20 if head else 10})
            out.append({"shape": shape, "product": product, "n": n, "k": k, "rows": rows, "tiling": A, "us": fused})
    return out


def _sweep(tmp_path, products: set[str]):
    """A products report of ``products`` (:func:`_results`) on a two-layer shape file."""
    shape = tmp_path / "two-layers.json"
    shape.write_text(json.dumps({"vocab_size": 64, "hidden_size": 8, "intermediate_size": 16, "num_layers": 2,
                                 "num_heads": 2, "num_kv_heads": 1, "head_dim": 4}))
    report = tmp_path / "products.json"
    report.write_text(json.dumps({"results": [r for r in _results(str(shape)) if r["product"] in products]}))
    return report


def _table(path, by_rows, agree: bool, invariant=A):
    shapes = [{"n": n, "k": k, "invariant": invariant, "tilings_agree": agree,
               "by_rows": [{"max_rows": m, "tiling": t, "fused": A} for m, t in by_rows]} for n, k in SHAPES.values()]
    path.write_text(json.dumps({"schema": SCHEMA, "device": "test", "dtype": "float16", "source": "test",
                                "shapes": shapes}))
    return str(path)


def test_each_table_is_priced_by_the_same_sweep(tmp_path, load_bench):
    bench = load_bench("bench_table_steps")
    products = _sweep(tmp_path, set(SHAPES))
    apart = _table(tmp_path / "apart.json", [(4, None)], agree=False)
    fused_one_row = _table(tmp_path / "fused.json", [(1, A)], agree=True)
    unswept = _table(tmp_path / "unswept.json", [(4, [16, 16, 64, 4, 3, 1, False])], agree=False)
    out = tmp_path / "steps.json"
    bench.main(["--products", str(products), "--tables", ",".join([apart, fused_one_row, unswept]),
                "--json", str(out)])
    tables = json.loads(out.read_text())["tables"]
    sums = {(path, r["rows"], r["mode"]): r["step_us"] for path, rows in tables.items() for r in rows}
    assert sums[(apart, 1, "default")] == sums[(apart, 4, "default")] == 2 * 40 + 20
    assert sums[(fused_one_row, 1, "default")] == 2 * 16 + 15
    assert sums[(fused_one_row, 4, "default")] == 2 * 40 + 20, "past the last bucket: the steps apart"
    assert sums[(apart, 4, "invariant")] == 2 * 32 + 30, "tilings that differ: the one invariant tiling"
    assert sums[(fused_one_row, 4, "invariant")] == 2 * 32 + 30, "tilings that agree: the last bucket's fused"
    assert sums[(unswept, 1, "default")] is None, "a choice the sweep did not time is missing, not zero"


def test_a_sweep_of_some_products_prices_their_share_of_a_step(tmp_path, load_bench):
    bench = load_bench("bench_table_steps")
    products = _sweep(tmp_path, {"qkv"})
    apart = _table(tmp_path / "apart.json", [(4, None)], agree=False)
    fused_one_row = _table(tmp_path / "fused.json", [(1, A)], agree=True)
    out = tmp_path / "steps.json"
    bench.main(["--products", str(products), "--tables", f"{apart},{fused_one_row}", "--json", str(out)])
    rows = json.loads(out.read_text())["tables"]
    sums = {(path, r["rows"], r["mode"]): r["step_us"] for path, table in rows.items() for r in table}
    assert sums[(apart, 1, "default")] == 2 * 10, "QKV alone: the layers x its time, no LM head"
    assert sums[(fused_one_row, 1, "default")] == 2 * 4
    assert all(set(r["products"]) == {"qkv"} for table in rows.values() for r in table)

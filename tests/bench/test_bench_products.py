"""``bench/bench_products.py``: the quick CPU run checks every candidate against the steps apart
through the Triton interpreter, and the table it writes from timings picks the fastest."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ngram_hal.kernels.triton import interpreting
from ngram_hal.kernels.triton.products import Tiling, choose

BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture
def bench_products(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.delitem(sys.modules, "bench_products", raising=False)
    import bench_products

    return bench_products


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_quick_run_checks_every_product_and_candidate(bench_products, tmp_path):
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps({"vocab_size": 96, "hidden_size": 64, "intermediate_size": 96, "num_layers": 2,
                                 "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "max_position_embeddings": 64}))
    out = tmp_path / "products.json"
    bench_products.main(["--device", "cpu", "--shapes", str(shape), "--rows", "1,3", "--quick", "--json", str(out)])
    results = json.loads(out.read_text())["results"]
    assert {(r["product"], r["n"], r["k"]) for r in results} == {
        ("qkv", 128, 64), ("o", 64, 64), ("gate_up", 192, 64), ("down", 64, 96), ("lm_head", 96, 64)}
    assert {r["candidate"] for r in results} == {"apart", "16x32x256", "16x16x64"}
    assert len(results) == 5 * 2 * 3
    assert all(r["max_rel_diff"] < 1e-4 and r["us"] is None for r in results), "float32, and no timings on the CPU"


def test_a_table_needs_timings(bench_products, tmp_path):
    with pytest.raises(SystemExit, match="--write-table needs timings"):
        bench_products.main(["--device", "cpu", "--shapes", "smollm2-135m", "--rows", "1", "--quick",
                             "--write-table", str(tmp_path / "t.json"), "--json",
                             str(tmp_path / "r.json")])


def test_the_table_takes_the_fastest_per_row_count_and_one_invariant_tiling(bench_products):
    a, b = [16, 32, 256, 4, 3], [16, 64, 128, 4, 3]
    times = {1: {None: 10.0, tuple(a): 5.0, tuple(b): 6.0}, 16: {None: 4.0, tuple(a): 9.0, tuple(b): 6.0},
             64: {None: 8.0, tuple(a): 12.0, tuple(b): 10.0}}
    results = [{"n": 8, "k": 4, "rows": rows, "tiling": None if t is None else list(t), "us": us}
               for rows, cands in times.items() for t, us in cands.items()]
    table = bench_products.choose_table(results, "gpu", torch.bfloat16, "test")
    choice = table.lookup(8, 4)
    assert [choose(choice, rows) for rows in (1, 16, 64)] == [Tiling(*a), None, None]
    assert choice.invariant == Tiling(*b), "b: 6/5 + 6/4 + 10/8 against a: 1 + 9/4 + 12/8"
    assert table.device == "gpu" and table.dtype == "bfloat16"

"""``bench/bench_cpu_attention.py``: the CPU attention kernel against torch's path."""

from __future__ import annotations

import json


def test_both_sides_agree_and_are_timed(load_bench, tmp_path):
    bench = load_bench("bench_cpu_attention")
    out = tmp_path / "attention.json"
    report = bench.main(["--queries", "1,3", "--contexts", "5,40", "--calls", "10", "--json", str(out)])
    assert [(r["queries"], r["keys"]) for r in report["results"]] == [(1, 5), (1, 40), (3, 5), (3, 40)]
    for row in report["results"]:
        assert row["torch_us"] > 0 and row["kernel_us"] > 0
        assert row["kernel_over_torch"] == row["kernel_us"] / row["torch_us"]
    assert json.loads(out.read_text())["kernel_queries"] == report["kernel_queries"]


def test_the_mask_is_causal_over_the_blocks_last_positions(load_bench):
    bench = load_bench("bench_cpu_attention")
    q, k, v, rows, mask = bench.case(3, 10)
    assert q.shape == (1, 3, 9, 64) and rows.shape == (1, 10) and len(set(rows[0].tolist())) == 10
    assert mask[0].sum(1).tolist() == [8, 9, 10]

"""``bench/bench_kernels.py --quick`` runs on the CPU through the Triton interpreter and reports
every op it times, the targets and the copy bandwidth."""

from __future__ import annotations

import json

import pytest

from ngram_hal.kernels.triton import interpreting


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_quick_run_reports_every_op(tmp_path, load_bench, capsys):
    pytest.importorskip("triton")
    bench_kernels = load_bench("bench_kernels")

    out = tmp_path / "kernels.json"
    bench_kernels.main(["--device", "cpu", "--quick", "--json", str(out)])
    report = json.loads(out.read_text())
    ops = {row["op"] for row in report["results"]}
    assert ops == {"alloc_extend", "assign_req_to_token", "gather_cache_locs", "accepted_kv_moves", "store_kv",
                   "move_kv", "attention"}
    for row in report["results"]:
        assert row["cuda_eager_us"] > 0 and row["ref_eager_us"] > 0, row
        assert row["cuda_graph_us"] is None, "no graphs on the CPU"
    moves = [row for row in report["results"] if row["op"] == "move_kv"]
    assert [row["pairs"] for row in moves] == list(bench_kernels.QUICK_MOVE_PAIRS)
    assert all(row["floor_us"] > 0 and row["torch_eager_us"] > 0 for row in moves)
    assert report["copy_bandwidth_bytes_per_s"] > 0
    attention = [row for row in report["results"] if row["op"] == "attention"]
    assert all(row["sdpa_eager_us"] > 0 and row["rel_error_vs_sdpa"] < 2e-2 for row in attention)
    assert any(row.get("sweep") for row in attention), "the launch-settings sweep did not run"
    assert {t["target"].split(":")[0].split(" ")[0] for t in report["targets"]} >= {"move_kv", "alloc_extend"}
    assert "targets" in capsys.readouterr().out

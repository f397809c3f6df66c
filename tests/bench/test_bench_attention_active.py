"""``bench/bench_attention_active.py --quick`` runs on the CPU through the Triton interpreter: in
both modes the active rows equal the all-active call's bit for bit and the rest are zero (the script
stops otherwise), and the report holds every setting and the drawn active nodes."""

from __future__ import annotations

import json

import pytest

from ngram_hal.kernels.triton import interpreting


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_quick_run_agrees_and_reports_every_setting(tmp_path, load_bench):
    pytest.importorskip("triton")
    bench = load_bench("bench_attention_active")

    out = tmp_path / "attention-active.json"
    assert bench.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["invariant"] for r in report["results"]] == [False, True]
    for row in report["results"]:
        assert set(row["us"]) == set(bench.SETTINGS)
        assert all(us is None for us in row["us"].values()), "no graphs on the CPU"
        assert all(k in (1, row["tree_size"]) for k in row["active_nodes_mix"])

"""``bench/bench_argmax.py --quick`` runs on the CPU through the Triton interpreter: every setting
gives torch's tokens (the script stops otherwise) and the report has a row per vocabulary and row
count."""

from __future__ import annotations

import json

import pytest

from ngram_hal.kernels.triton import interpreting


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_quick_run_agrees_with_torch(tmp_path, load_bench):
    pytest.importorskip("triton")
    bench_argmax = load_bench("bench_argmax")

    out = tmp_path / "argmax.json"
    assert bench_argmax.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [(r["vocab"], r["rows"]) for r in report["results"]] == [(1000, 1), (1000, 3), (9000, 1), (9000, 3)]
    for row in report["results"]:
        assert set(row["us"]) == set(bench_argmax.SETTINGS)
        assert all(us is None for us in row["us"].values()), "no graphs on the CPU"

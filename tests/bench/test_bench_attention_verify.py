"""``bench/bench_attention_verify.py --quick`` runs on the CPU through the Triton interpreter: every
setting on decode, branching-tree and chain cases, the invariant settings of one split size bit for bit equal (the
script stops otherwise), and the report names each setting's launch options."""

from __future__ import annotations

import json

import pytest

from ngram_hal.kernels.triton import interpreting


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_quick_run_agrees_and_reports_every_setting(tmp_path, load_bench):
    pytest.importorskip("triton")
    bench_attention_verify = load_bench("bench_attention_verify")

    out = tmp_path / "attention-verify.json"
    assert bench_attention_verify.main(["--device", "cpu", "--quick", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert set(report["settings"]) == set(bench_attention_verify.SETTINGS)
    assert report["settings"]["invariant, one per split"]["attn_programs"] == 1 << 20
    assert report["settings"]["invariant, fill 1"]["attn_invariant_fill"] == 1
    assert report["settings"]["invariant, 64-key steps"]["attn_key_bytes"] == 4096
    assert [(r["tree_size"], r["chain"]) for r in report["results"]] == [(1, False), (16, False), (16, True)]
    for row in report["results"]:
        assert set(row["us"]) == set(bench_attention_verify.SETTINGS)
        assert all(us is None for us in row["us"].values()), "no graphs on the CPU"
        assert row["max_abs_diff"] <= 0.02

"""``bench/bench_attention_sweep.py --quick`` runs on the CPU through the Triton interpreter: the
settings a ``--knob`` names agree with the default's output on decode and tree cases, and the
report holds every setting of every case; a knob outside the sweep's fields is refused."""

from __future__ import annotations

import json

import pytest

from ngram_hal.kernels.triton import interpreting


@pytest.fixture
def sweep(load_bench):
    return load_bench("bench_attention_sweep")


@pytest.mark.skipif(not interpreting(), reason="the quick CPU run needs TRITON_INTERPRET=1")
def test_quick_run_agrees_and_reports_every_setting(sweep, tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "sweep.json"
    knobs = ["--knob", "attn_tree_block_m=16,64", "--knob", "attn_programs=none", "--knob", "attn_block_m=64",
             "--knob", "attn_key_bytes=8192", "--knob", "attn_num_stages=2", "--knob", "attn_warps=4"]
    assert sweep.main(["--device", "cpu", "--quick", "--json", str(out), *knobs]) == 0
    report = json.loads(out.read_text())
    assert report["knobs"]["attn_tree_block_m"] == [16, 64]
    assert report["knobs"]["attn_programs"] == [None]
    assert [(r["tree_size"], r["chain"]) for r in report["results"]] == [(1, False), (16, False), (16, True)]
    for row in report["results"]:
        assert [s["setting"]["attn_tree_block_m"] for s in row["settings"]] == [16, 64]
        assert all(s["us"] is None for s in row["settings"]), "no graphs on the CPU"
        assert all(s["max_abs_diff"] <= 0.02 for s in row["settings"])


def test_unknown_knob_is_refused(sweep):
    with pytest.raises(SystemExit, match="attn_fast"):
        sweep.parse_knobs(["attn_fast=1,2"])
    assert sweep.parse_knobs(["attn_programs=none,132"])["attn_programs"] == (None, 132)

"""``bench/bench_vs_transformers.py``: the CPU targets it reports per group of prompts."""

from __future__ import annotations


import pytest


@pytest.fixture
def bench_vs(load_bench):
    return load_bench("bench_vs_transformers")


def _sums(**rates):
    return {name: {"tokens_per_s": rate} for name, rate in rates.items()}


def test_targets_compare_our_default_with_their_prompt_lookup(bench_vs):
    met = bench_vs.cpu_targets(_sums(ours_plain=20.0, ours_auto=30.0, hf_plain=10.0, hf_pld=14.0))
    assert met["auto_speedup"] == pytest.approx(1.5) and met["hf_pld_speedup"] == pytest.approx(1.4)
    assert met["speedup_met"] is True
    assert met["auto_over_hf_pld_tok_s"] == pytest.approx(30 / 14) and met["tok_s_met"] is True
    short = bench_vs.cpu_targets(_sums(ours_plain=20.0, ours_auto=21.0, hf_plain=10.0, hf_pld=15.0))
    assert short["speedup_met"] is False and short["tok_s_met"] is False
    missing = bench_vs.cpu_targets(_sums(ours_plain=20.0, ours_auto=21.0))
    assert missing["speedup_met"] is None and missing["tok_s_met"] is None


def test_decode_speedup_leaves_out_the_prefill(bench_vs):
    sums = {"plain": {"seconds": 10.0}, "spec": {"seconds": 6.0}}
    # 4 s of prefill on both sides: 6 s of decoding against 2 s.
    assert bench_vs.decode_speedup(sums, "spec", "plain", 4.0) == pytest.approx(3.0)
    assert bench_vs.decode_speedup(sums, "spec", "plain", 0.0) == pytest.approx(10 / 6)
    assert bench_vs.decode_speedup(sums, "spec", "plain", 6.0) is None, "no time left after the prefill"
    assert bench_vs.decode_speedup(sums, "spec", "missing", 1.0) is None

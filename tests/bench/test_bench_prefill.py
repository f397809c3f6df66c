"""``bench/bench_prefill.py`` on the CPU: a case's runs are one prefill step each (no captured
steps, so no bound on an admission), timed and reported; bad counts are refused."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def bench(load_bench):
    return load_bench("bench_prefill")


def test_one_prompt_is_one_prefill_step(bench, model_file, two_prompts, tmp_path):
    out = tmp_path / "prefill.json"
    assert bench.main(["--device", "cpu", "--prompts", str(two_prompts), "--requests", "1", "--reps", "2",
                       "--warmup", "0", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["graphs"] is False and report["prefill_cap"] is None
    [case] = report["cases"]
    assert case["bound"] == "none" and case["requests"] == 1 and case["prefill_steps_per_run"] == 1.0
    assert 10 < case["tokens"] < 40, "the copy-heavy prompt, not the open-ended one"
    assert case["ms_per_run"] == pytest.approx(case["ms_per_step"]) and case["ms_per_step"] > 0


@pytest.mark.parametrize("argv,message", [(["--requests", "0"], "greater than or equal to 1"),
                                          (["--requests", "a"], "valid integer"),
                                          (["--reps", "0"], "too few")])
def test_bad_options_are_refused(bench, argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(argv)
    assert message in capsys.readouterr().err

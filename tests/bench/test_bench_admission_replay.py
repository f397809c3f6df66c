"""``bench/bench_admission_replay.py``: continuous batching replayed with and without gathered admission."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def bench(load_bench):
    return load_bench("bench_admission_replay")


# Three seats; the first request ends after one step, the second after two; two more wait.
STEPS, TOKENS = [1, 2, 9, 1, 1], [10] * 5


def test_without_the_gate_each_freed_seat_is_refilled_at_once(bench):
    got = bench.replay(STEPS, TOKENS, 3, step_s=1.0, prefill_s=2.0, token_s=0.0, patience=None)
    # fill [0 1 2]; decode; refill [3]; decode; refill [4]; 7 decodes for the long request's rest
    assert got == {"prefill_steps": 3, "decode_steps": 9, "seconds": 3 * 2.0 + 9 * 1.0}


def test_the_gate_waits_for_the_second_seat(bench):
    got = bench.replay(STEPS, TOKENS, 3, step_s=1.0, prefill_s=2.0, token_s=0.0, patience=0.5)
    # one seat free, two waiting: the gate holds (a third of a 1 s step idle, under half of 2 s);
    # the next step frees the second seat and both come in one prefill
    assert got == {"prefill_steps": 2, "decode_steps": 9, "seconds": 2 * 2.0 + 9 * 1.0}


def test_costs_come_from_the_anchor_and_the_wall_times(bench):
    runs = [{"run": "a", "totals": {"wall_s": 1.0, "decode_steps": 100, "prefill_steps": 10}},
            {"run": "b", "totals": {"wall_s": 2.0, "decode_steps": 400, "prefill_steps": 20}}]
    prefill_s, step_s = bench.step_costs(runs, "a", 5.0)
    assert prefill_s == pytest.approx(0.05)
    assert step_s == pytest.approx({"a": 0.005, "b": 0.0025})


def _report(tmp_path):
    path = tmp_path / "engine.json"
    run = {"status": "ok", "batch": 3, "requests": [f"r{i}" for i in range(5)], "verify_steps": STEPS}
    path.write_text(json.dumps({
        "prompts": [{"id": f"r{i}", "prompt_tokens": 10} for i in range(5)],
        "runs": [{**run, "run": "spec8", "totals": {"wall_s": 0.015, "decode_steps": 9, "prefill_steps": 3}},
                 {**run, "run": "plain", "batch": 1, "totals": {"wall_s": 1.0, "decode_steps": 9,
                                                                 "prefill_steps": 5}}]}))
    return path


def test_main_replays_the_batched_runs(bench, tmp_path, capsys):
    out = tmp_path / "replay.json"
    assert bench.main(["--outputs", str(_report(tmp_path)), "--anchor", "spec8=1", "--patience", "0.5,1",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["prefill_fixed_s"] == pytest.approx(0.002)
    rows = [(r["run"], r["patience"], r["prefill_steps"], r["decode_steps"]) for r in result["rows"]]
    assert rows == [("spec8", None, 3, 9), ("spec8", 0.5, 2, 9), ("spec8", 1.0, 2, 9)], "batch 1 is not replayed"
    assert result["rows"][1]["vs_no_gate"] == pytest.approx(15 / 13)
    assert "gate, patience 0.5" in capsys.readouterr().out


def test_bad_arguments_are_named(bench, tmp_path, capsys):
    report = _report(tmp_path)
    for bad, says in ((["--anchor", "nope=1"], "--anchor nope: no such run in the report (runs: spec8)"),
                      (["--anchor", "spec8=10"], "its decode steps alone exceed the run's wall time"),
                      (["--anchor", "spec8=1", "--patience", "0.5,0"], "every patience must be above 0")):
        with pytest.raises(SystemExit):
            bench.main(["--outputs", str(report), *bad])
        assert says in capsys.readouterr().err
    lone = tmp_path / "lone.json"
    lone.write_text(json.dumps({"prompts": [], "runs": [{"status": "ok", "batch": 1, "run": "plain"}]}))
    with pytest.raises(SystemExit):
        bench.main(["--outputs", str(lone), "--anchor", "plain=1"])
    assert "no batched run to replay" in capsys.readouterr().err

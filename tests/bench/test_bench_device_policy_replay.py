"""``bench/bench_device_policy_replay.py``: ``auto`` with device drafts, replayed over known outputs."""

from __future__ import annotations

import json
import random

import pytest

COSTS = {1: {1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2}, 2: {1: 1.5, 2: 1.6, 4: 1.7, 8: 2.0}}


@pytest.fixture
def replay(load_bench):
    return load_bench("bench_device_policy_replay")


def _outputs() -> list[tuple[list[int], list[int]]]:
    """A request that copies its prompt's passage word for word, and one whose output the prompt
    never saw (distinct tokens: nothing ever matches)."""
    rng = random.Random(0)
    passage = rng.sample(range(100, 200), 60)
    return [([1, 2, 3] + passage + [4, 5], passage[:48]), ([1, 2, 3, 6], rng.sample(range(300, 400), 48))]


def test_every_setting_commits_every_token_and_pays_its_sizes(replay):
    for batch in (1, 2):
        rows = {r["setting"]: r for r in replay.replay_rows(_outputs(), COSTS, batch)}
        assert list(rows) == ["plain", "fixed 2", "fixed 4", "fixed 8", "auto8"]
        assert all(r["tokens"] == 2 * 47 for r in rows.values()), "each output's first token came from its prefill"
        assert rows["plain"]["steps"] == {1: 47 if batch == 2 else 94} and rows["plain"]["speedup"] == 1.0
    alone = {r["setting"]: r for r in replay.replay_rows(_outputs(), COSTS, 1)}
    # The copy takes 6 steps of 8 nodes; the fresh text commits one token a step at 8 nodes' cost.
    assert alone["fixed 8"]["steps"] == {8: 6 + 47}
    assert alone["fixed 8"]["seconds"] == pytest.approx(53 * 1.2)


def test_auto_speculates_for_the_copy_and_not_for_the_fresh_text(replay):
    """Alone, the copying request's record makes long chains pay and the fresh one's makes plain
    steps best (past the first few steps its record needs): ``auto`` beats every fixed size."""
    rows = {r["setting"]: r for r in replay.replay_rows(_outputs(), COSTS, 1)}
    best_fixed = max(r["speedup"] for name, r in rows.items() if name.startswith("fixed"))
    assert rows["auto8"]["speedup"] > best_fixed
    assert rows["auto8"]["steps"].get(1, 0) > 30


def test_costs_come_from_the_auto_device_runs_of_a_report(replay):
    report = {"runs": [
        {"run": "auto8", "policy": "auto", "drafter": "trie", "step_costs": {"1": {"1": 9.0}}},
        {"run": "auto8-device", "policy": "auto", "drafter": "device", "step_costs": {"1": {"1": 0.001, "8": 0.002}}},
        {"run": "auto8-device", "policy": "auto", "drafter": "device",
         "step_costs": {"1": {"1": 7.0}, "2": {"1": 0.003}}},
    ]}
    assert replay.step_costs(report) == {1: {1: 0.001, 8: 0.002}, 2: {1: 0.003}}


def test_the_command_replays_a_reports_outputs(replay, model_file, two_prompts, tmp_path):
    report = tmp_path / "engine.json"
    report.write_text(json.dumps({"runs": [
        {"batch": 1, "run": "plain", "requests": ["echo", "sky"], "token_ids": [[5, 6, 5, 6, 5, 6], [7, 8, 9]]},
        {"batch": 1, "run": "auto8-device", "policy": "auto", "drafter": "device",
         "step_costs": {"1": {"1": 0.001, "2": 0.0011, "4": 0.0012, "8": 0.0013}}}]}))
    out = tmp_path / "replay.json"
    rows = replay.main(["--engine-report", str(report), "--prompts", str(two_prompts), "--batch-sizes", "1",
                        "--json", str(out)])
    assert [r["setting"] for r in rows] == ["plain", "fixed 2", "fixed 4", "fixed 8", "auto8"]
    assert all(r["tokens"] == 5 + 2 for r in rows)
    written = json.loads(out.read_text())
    assert written["schema"] == "ngram-hal-bench-device-policy-replay/1" and len(written["rows"]) == 5
    with pytest.raises(SystemExit):
        replay.main(["--engine-report", str(report), "--costs-report", str(tmp_path / "missing.json"),
                     "--prompts", str(two_prompts)])

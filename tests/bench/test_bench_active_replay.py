"""``bench/bench_active_replay.py``: the device drafter's chains replayed over known outputs, per
rule for a chain's active nodes."""

from __future__ import annotations

import json
import random

import pytest



@pytest.fixture
def bench(load_bench):
    return load_bench("bench_active_replay")


def _copy_and_fresh() -> list[tuple[list[int], list[int]]]:
    """A request whose output copies a passage of its prompt, then one whose output the prompt never
    saw (distinct tokens: nothing matches)."""
    rng = random.Random(0)
    passage = rng.sample(range(100, 200), 60)
    return [([1, 2, 3] + passage + [4, 5], passage[:48]), ([1, 2, 3, 6], rng.sample(range(300, 400), 48))]


def test_rules_parse_and_bad_rules_are_named(bench):
    assert [bench.parse_rule("1/5")(m, 16) for m in (0, 1, 2, 8)] == [1, 5, 16, 16]
    assert [bench.parse_rule("n/n")(m, 16) for m in (0, 1, 2)] == [16, 16, 16]
    assert bench.parse_rule("1/32")(1, 16) == 16
    for text in ("1", "0/5", "a/b", "1/5/7", "-1/5"):
        with pytest.raises(ValueError, match=f"{text!r}"):
            bench.parse_rule(text)


def test_replay_commits_every_output_token(bench):
    (prompt, copy), (fresh_prompt, fresh) = _copy_and_fresh()
    steps = bench.replay(prompt, copy, 16, bench.parse_rule("n/n"))
    assert sum(a + 1 for _, _, a in steps) == len(copy) - 1  # out[0] came from the prefill
    assert [(n, a) for _, n, a in steps] == [(16, 15), (16, 15), (16, 14)] and steps[0][0] == 1
    steps = bench.replay(fresh_prompt, fresh, 16, bench.library_rule)
    assert len(steps) == len(fresh) - 1 and all((m, n, a) == (0, 1, 0) for m, n, a in steps)
    cut = bench.replay(prompt, copy, 16, bench.parse_rule("n/2"))
    assert [(m, n, a) for m, n, a in cut[:2]] == [(1, 2, 1), (3, 16, 15)], "the one-token match verifies 2 nodes"
    assert sum(a + 1 for _, _, a in cut) == len(copy) - 1


def test_rule_rows_and_acceptance(bench):
    outputs = _copy_and_fresh()
    rules = {"n/n": bench.parse_rule("n/n"), "active_nodes": bench.library_rule, "1/1": bench.parse_rule("1/1")}
    rows = {r["rule"]: r for r in bench.rule_rows(outputs, 8, rules)}
    assert rows["n/n"]["vs_every_node"] == 1.0 and rows["n/n"]["mean_active_nodes"] == 8
    assert rows["active_nodes"]["tokens_per_verify_step"] == rows["n/n"]["tokens_per_verify_step"]
    assert rows["active_nodes"]["mean_active_nodes"] < 8, "the fresh request verifies its root alone"
    acceptance = {r["match_length"]: r for r in bench.acceptance_rows(outputs, 8, [1, 5])}
    assert acceptance[0]["mean_accepted"] == 0 and acceptance[0]["lost_past"] == {"1": 0, "5": 0}
    # after the first step's one-token match, five steps continue eight tokens: 7, 7, 7, 7 drafts
    # accepted, then 6 before the output's last token; past five nodes (four drafts) 3 + 3 + 3 + 3 + 2
    assert acceptance[8]["positions"] == 5 and acceptance[8]["mean_accepted"] == pytest.approx(6.8)
    assert acceptance[8]["lost_past"]["5"] == 14
    assert sum(r["share"] for r in acceptance.values()) == pytest.approx(1.0)


def test_main_replays_a_bench_engine_report(bench, model_file, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"id": "echo", "kind": "copy", "messages": [
        {"role": "user", "content": "Repeat: red blue red blue red"}]}) + "\n")
    ids = [2771, 4011, 2771, 4011, 2771, 4011, 2771, 4011]
    report = tmp_path / "engine.json"
    report.write_text(json.dumps({"runs": [{"run": "plain", "requests": ["echo", "echo"], "token_ids": [ids, ids]}]}))
    out = tmp_path / "replay.json"
    assert bench.main(["--outputs", str(report), "--prompts", str(prompts), "--rules", "1/5",
                       "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["requests"] == ["echo"]
    assert [r["rule"] for r in result["rules"]] == ["n/n", "active_nodes", "1/5"]
    assert all(r["tokens"] == len(ids) - 1 for r in result["rules"])
    capsys.readouterr()
    for bad, says in ((["--outputs", str(prompts)], "no plain run with token ids"),
                      (["--outputs", str(report), "--limit", "0"], "--limit: '0': expected an int of at least 1"),
                      (["--outputs", str(report), "--tree-size", "1"], "expected an int of at least 2"),
                      (["--outputs", str(report), "--rules", "1/0"], "'1/0' is not NONE/ONE")):
        with pytest.raises(SystemExit):
            bench.main([*bad, "--prompts", str(prompts)])
        assert says in capsys.readouterr().err
    report.write_text(json.dumps({"runs": [{"run": "plain", "requests": ["echo"], "token_ids": [ids[:1]]}]}))
    with pytest.raises(SystemExit):
        bench.main(["--outputs", str(report), "--prompts", str(prompts)])
    assert "no request has two output tokens or more" in capsys.readouterr().err

"""``bench/bench_policy_replay.py``: the replay of the speculation policy over known outputs."""

from __future__ import annotations

import random

import pytest

COSTS = {1: 1.0, 2: 1.2, 4: 1.5, 8: 2.6}


@pytest.fixture
def replay(load_bench):
    return load_bench("bench_policy_replay")


def _outputs() -> list[dict]:
    """A request that copies its prompt's passage word for word, and one whose output the prompt
    never saw (distinct tokens: nothing ever matches)."""
    rng = random.Random(0)
    passage = rng.sample(range(100, 200), 60)
    return [{"kind": "quote", "prompt": [1, 2, 3] + passage + [4, 5], "out": passage[:48]},
            {"kind": "open", "prompt": [1, 2, 3, 6], "out": rng.sample(range(300, 400), 48)}]


def test_plain_steps_commit_one_token_and_copies_many(replay):
    quote, fresh = _outputs()
    assert len(list(replay.steps_of(quote["prompt"], quote["out"], lambda length, run: 1))) == 47
    steps = list(replay.steps_of(quote["prompt"], quote["out"], lambda length, run: 8))
    assert len(steps) == 6 and all(length > 0 and n == 8 for length, _, n in steps)
    assert all(length == 0 and n == 1 for length, _, n in replay.steps_of(fresh["prompt"], fresh["out"],
                                                                          lambda length, run: 8))


def test_acceptance_by_match_length(replay):
    rows = {row["match_length"]: row for row in replay.acceptance_by_match(_outputs())}
    assert rows[0]["p_first"] == 0.0 and rows[0]["mean_run"] == 0.0
    long = max(n for n in rows if n > 0)
    assert rows[long]["p_first"] == 1.0 and rows[long]["mean_run"] > 5


def test_replay_ranks_the_settings(replay):
    """Text the prompt never saw runs plain at plain's cost; the copied passage gains with every
    setting, the clairvoyant choice bounds them all, and scoring by match length copies at more
    than twice plain's speed."""
    table = replay.replay_table(_outputs(), COSTS)
    assert set(table) == {"fixed 2", "fixed 4", "fixed 8", "auto, own records", "auto, by match", "clairvoyant"}
    for name, row in table.items():
        assert row["open"] == pytest.approx(1.0), name
        assert row["quote"] > 1.0, name
        assert table["clairvoyant"]["quote"] >= row["quote"] - 1e-9, name
    assert table["auto, by match"]["quote"] > 2.0


def test_costs_are_parsed_and_checked(replay):
    assert replay.parse_costs("1=0.01,8=0.03") == {1: 0.01, 8: 0.03}
    for bad in ("2=0.01", "1=x", "1=0"):
        with pytest.raises(SystemExit, match="--costs"):
            replay.parse_costs(bad)

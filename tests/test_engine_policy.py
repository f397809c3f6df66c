"""The speculation policy: D when speculation is measured faster, 1 when it would lose, with probes."""

from __future__ import annotations

import pytest

from ngram_hal.engine.policy import SpecPolicy


def drive(policy: SpecPolicy, steps: int, cost: dict[int, float], tokens: dict[int, float], rows: int = 16):
    chosen = []
    for _ in range(steps):
        n = policy.choose()
        chosen.append(n)
        policy.observe(n, rows, int(tokens[n] * rows), cost[n] * rows)
    return chosen


def test_always_uses_d():
    policy = SpecPolicy(8, "always")
    assert drive(policy, 10, {8: 1.0, 1: 0.1}, {8: 1.0, 1: 1.0}) == [8] * 10


def test_auto_turns_speculation_down_when_it_loses():
    # 8 nodes cost 3x a plain step but commit only 1.5 tokens: plain wins, spec is probed now and then.
    policy = SpecPolicy(8, "auto", probe_every=8)
    chosen = drive(policy, 60, {8: 0.3, 1: 0.1}, {8: 1.5, 1: 1.0})
    tail = chosen[10:]
    assert tail.count(1) > 0.8 * len(tail)
    assert 8 in tail
    assert policy.rate(1) > policy.rate(8)


def test_auto_keeps_speculation_when_it_wins():
    policy = SpecPolicy(8, "auto", probe_every=8)
    chosen = drive(policy, 60, {8: 0.15, 1: 0.1}, {8: 4.0, 1: 1.0})
    tail = chosen[10:]
    assert tail.count(8) > 0.8 * len(tail)
    assert 1 in tail


def test_auto_follows_a_change_in_the_workload():
    policy = SpecPolicy(8, "auto", probe_every=4)
    drive(policy, 40, {8: 0.3, 1: 0.1}, {8: 1.2, 1: 1.0})
    assert policy.choose() in (1, 8)
    chosen = drive(policy, 60, {8: 0.3, 1: 0.1}, {8: 6.0, 1: 1.0})
    assert chosen[-20:].count(8) > 14


def test_untimed_samples_update_acceptance_only():
    policy = SpecPolicy(8, "auto")
    policy.observe(8, 4, 12, None)
    assert policy.rate(8) is None
    policy.observe(8, 4, 12, 0.4)
    assert policy.rate(8) == pytest.approx(3.0 / 0.1)


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        SpecPolicy(8, "sometimes")

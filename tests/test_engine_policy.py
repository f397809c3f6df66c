"""The speculation policy: the tree size measured fastest among 1, 2, 4, ..., D, with probes."""

from __future__ import annotations

import pytest

from ngram_hal.engine.policy import SpecPolicy, tree_sizes


def drive(policy: SpecPolicy, steps: int, cost: dict[int, float], tokens: dict[int, float], rows: int = 16):
    chosen = []
    for _ in range(steps):
        n = policy.choose()
        chosen.append(n)
        policy.observe(n, rows, int(tokens[n] * rows), cost[n] * rows)
    return chosen


def test_tree_sizes():
    assert tree_sizes(8) == [1, 2, 4, 8]
    assert tree_sizes(6) == [1, 2, 4, 6]
    assert tree_sizes(1) == [1]
    assert SpecPolicy(8, "always").sizes == [8]


def test_always_uses_d():
    policy = SpecPolicy(8, "always")
    assert drive(policy, 10, {8: 1.0, 1: 0.1}, {8: 1.0, 1: 1.0}) == [8] * 10


def test_auto_turns_speculation_down_when_it_loses():
    # Every tree costs more than it commits: plain wins after one trial of two nodes; the larger
    # trees are never tried (a local search), and two nodes are probed now and then.
    policy = SpecPolicy(8, "auto", probe_every=4)
    chosen = drive(policy, 80, {1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3}, {1: 1.0, 2: 1.2, 4: 1.4, 8: 1.5})
    assert chosen[:2] == [1, 2]
    tail = chosen[10:]
    assert tail.count(1) > 0.85 * len(tail) and 2 in tail
    assert policy.chosen[4] == policy.chosen[8] == 0
    assert policy.rate(4) is None and max(policy.sizes, key=lambda n: policy.rate(n) or 0) == 1


def test_auto_climbs_while_larger_trees_win():
    policy = SpecPolicy(8, "auto", probe_every=8)
    chosen = drive(policy, 12, {1: 0.1, 2: 0.11, 4: 0.12, 8: 0.15}, {1: 1.0, 2: 1.8, 4: 2.8, 8: 4.0})
    assert chosen[:5] == [1, 2, 4, 8, 8]


def test_auto_keeps_speculation_when_it_wins():
    policy = SpecPolicy(8, "auto", probe_every=8)
    chosen = drive(policy, 60, {1: 0.1, 2: 0.11, 4: 0.12, 8: 0.15}, {1: 1.0, 2: 1.8, 4: 2.8, 8: 4.0})
    tail = chosen[10:]
    assert tail.count(8) > 0.8 * len(tail)
    assert set(tail) - {8}


def test_auto_picks_a_middle_size():
    # A batch where 8 nodes per request make the step compute-bound: 4 nodes give the best rate.
    policy = SpecPolicy(8, "auto", probe_every=8)
    chosen = drive(policy, 60, {1: 0.1, 2: 0.11, 4: 0.13, 8: 0.4}, {1: 1.0, 2: 1.6, 4: 2.4, 8: 3.0})
    assert chosen[10:].count(4) > 0.8 * len(chosen[10:])


def test_auto_follows_a_change_in_the_workload():
    policy = SpecPolicy(8, "auto", probe_every=4)
    cost = {1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3}
    drive(policy, 40, cost, {1: 1.0, 2: 1.1, 4: 1.15, 8: 1.2})
    assert policy.choose() in policy.sizes
    chosen = drive(policy, 80, cost, {1: 1.0, 2: 1.9, 4: 3.5, 8: 6.0})
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


def test_probes_thin_out_while_the_best_size_holds():
    policy = SpecPolicy(8, "auto", probe_every=4, max_probe_every=32)
    chosen = drive(policy, 400, {1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3}, {1: 1.0, 2: 1.2, 4: 1.4, 8: 1.5})
    probes = [i for i, n in enumerate(chosen) if n != 1 and i >= 4]
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps[0] <= 8 and gaps[-1] == 32
    assert len(probes) < 20


def test_peek_tells_the_next_choice_and_changes_nothing():
    policy = SpecPolicy(8, "auto", probe_every=2)
    cost, tokens = {1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3}, {1: 1.0, 2: 1.2, 4: 1.4, 8: 1.5}
    for _ in range(40):
        before = (dict(policy.chosen), dict(policy._last_run), policy._steps)
        n = policy.peek()
        assert (dict(policy.chosen), dict(policy._last_run), policy._steps) == before
        assert policy.choose() == n
        policy.observe(n, 4, int(tokens[n] * 4), cost[n] * 4)


def test_one_stalled_step_does_not_move_the_choice():
    policy = SpecPolicy(8, "auto", probe_every=4)
    cost, tokens = {1: 0.1, 2: 0.15, 4: 0.2, 8: 0.3}, {1: 1.0, 2: 1.2, 4: 1.4, 8: 1.5}
    drive(policy, 20, cost, tokens)
    assert policy.peek() == 1
    policy.observe(1, 16, 16, 16 * 50.0)  # a size-1 step that took 500 times as long
    assert max(policy.sizes, key=lambda n: policy.rate(n) or 0) == 1
    assert drive(policy, 5, cost, tokens).count(1) >= 4


def test_auto_scores_the_slowest_request():
    """Half the batch copies (5 tokens a step at size 8), half never accepts a draft (1 token):
    the mean (3 tokens for a 2x dearer step) favours 8 nodes, but the batch ends with its
    slow half, which 8 nodes only slow down; scored by the slowest request, auto stays plain."""
    cost = {1: 0.1, 2: 0.13, 4: 0.16, 8: 0.2}
    fast = {1: 1, 2: 2, 4: 3, 8: 5}
    for slowest, want in ((None, 8), (True, 1)):
        policy = SpecPolicy(8, "auto", probe_every=8)
        chosen = []
        for _ in range(60):
            n = policy.choose()
            chosen.append(n)
            tokens = 8 * fast[n] + 8 * 1
            policy.observe(n, 16, tokens, cost[n] * 16, 1 if slowest else None)
        tail = chosen[20:]
        assert max(set(tail), key=tail.count) == want, (slowest, chosen)


def test_auto_prefers_the_smaller_size_within_the_margin():
    """Where the host sets the pace every size takes about as long and commits about as much:
    two nodes estimated 3% faster than plain (noise, as far as the policy can tell) do not win,
    with the default margin of 5%; without a margin they do."""
    cost = {1: 0.1, 2: 0.097, 4: 0.105, 8: 0.11}
    tokens = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}
    for margin, want in ((0.05, 1), (0.0, 2)):
        chosen = drive(SpecPolicy(8, "auto", probe_every=8, margin=margin), 60, cost, tokens)
        tail = chosen[10:]
        assert tail.count(want) > 0.8 * len(tail), (margin, chosen)
    with pytest.raises(ValueError, match="margin"):
        SpecPolicy(8, "auto", margin=-0.1)

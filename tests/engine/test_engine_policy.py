"""The speculation policy: step costs against each request's expected tokens, for the whole batch."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from ngram_hal.engine.policy import MATCH_CLASSES, NO_DRAFTS, Acceptance, SpecPolicy, StepCosts, match_class, tree_sizes

COSTS = {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.6}
"""Seconds per step by tree size: rows cheap up to 8 nodes, a compute-bound 16."""


def expected(p: float, drafts: int) -> float:
    return sum(p ** k for k in range(drafts + 1))


def best_size(ps: list[float], costs: dict[int, float], margin: float = 0.05) -> int:
    """The size of the highest expected tokens per second of a batch whose requests accept each
    next draft with probabilities ``ps``, or plain where it beats plain by less than ``margin``:
    the right answer, by brute force over the true rates."""
    rates = {n: sum(expected(p, n - 1) for p in ps) / costs[n] for n in sorted(costs)}
    best = max(rates, key=rates.__getitem__)
    return best if rates[best] >= rates[1] * (1 + margin) else 1


def simulate(policy: SpecPolicy, ps: list[float], costs: dict[int, float], steps: int, seed: int = 0,
             bucket: int = 8) -> list[int]:
    """Serve a batch whose request b accepts each next draft with probability ``ps[b]``, each step
    costing ``costs[n]``; the sizes the policy chose."""
    rng = random.Random(seed)
    records = [Acceptance() for _ in ps]
    chosen = []
    for _ in range(steps):
        n = policy.choose(bucket, records)
        chosen.append(n)
        for record, p in zip(records, ps):
            accepted = 0
            while accepted < n - 1 and rng.random() < p:
                accepted += 1
            record.add(n - 1, accepted)
        policy.observe(bucket, n, costs[n])
    return chosen


def test_tree_sizes():
    assert tree_sizes(8) == [1, 2, 4, 8]
    assert tree_sizes(6) == [1, 2, 4, 6]
    assert tree_sizes(1) == [1]
    assert SpecPolicy(8, "always").sizes == [8]


def test_always_uses_d():
    assert simulate(SpecPolicy(8, "always"), [0.0], {8: 1.0}, 10) == [8] * 10


def test_acceptance_estimates_the_first_and_the_following_drafts():
    record = Acceptance()
    assert record.p_first == record.p_next == 0.5 and record.expected_tokens(0) == 1.0
    for _ in range(30):
        record.add(7, 7)  # every draft accepted: no rejection seen
    assert record.p_first > 0.9 and record.p_next > 0.9
    assert record.expected_tokens(7) == pytest.approx(1 + record.p_first * expected(record.p_next, 6))
    one = Acceptance(decay=1.0)
    for _ in range(300):
        one.add(7, 1)  # the first draft accepted, the second rejected, every step
    assert one.p_first > 0.99 and one.p_next < 0.01
    assert one.expected_tokens(7) == pytest.approx(2.0, abs=0.02)
    one.add(0, 0)  # a plain step offers nothing and tells nothing
    assert one.p_first > 0.99 and one.p_next < 0.01
    runs = Acceptance(decay=1.0)
    for step in range(300):
        runs.add(7, 7 if step % 2 else 0)  # half the steps copy the whole chain, half nothing
    assert runs.p_first == pytest.approx(0.5, abs=0.01) and runs.p_next > 0.99
    assert runs.expected_tokens(7) == pytest.approx(0.5 * 8 + 0.5 * 1, abs=0.05)
    never = Acceptance()
    for _ in range(30):
        never.add(1, 0)
    assert never.p_first < 0.1


def test_acceptance_follows_the_recent_text():
    record = Acceptance()
    for _ in range(20):
        record.add(7, 7)
    copying = record.p_first
    for _ in range(10):
        record.add(7, 0)
    after_ten = record.p_first
    for _ in range(10):
        record.add(7, 0)
    assert copying > 0.9 and after_ten < 0.4 and record.p_first < 0.2


@pytest.mark.parametrize("ps", [[0.9] * 4, [0.6] * 4, [0.3] * 4, [0.05] * 4], ids=["copy", "some", "little", "none"])
def test_auto_settles_on_the_size_with_the_highest_throughput(ps):
    """A synthetic batch whose acceptance and step costs are known: after a few steps the policy
    runs sizes whose true throughput is within 3% of the size a brute-force search over the true
    expected rates picks (sizes closer than that are a tie the estimates may break either way)."""
    policy = SpecPolicy(16, "auto", costs=_calibrated(COSTS))
    chosen = simulate(policy, ps, COSTS, 200)
    true = {n: sum(expected(p, n - 1) for p in ps) / COSTS[n] for n in COSTS}
    tail = chosen[40:]
    assert sum(true[n] for n in tail) / len(tail) >= 0.97 * true[best_size(ps, COSTS)]


def test_a_mixed_batch_speculates_for_its_copying_requests():
    """Two requests that copy beside six that do not: the batch's throughput is highest with a
    middle size (scoring the slowest request would run plain steps)."""
    ps = [0.95, 0.95] + [0.02] * 6
    assert best_size(ps, COSTS) > 1 and best_size([0.02], COSTS) == 1
    policy = SpecPolicy(16, "auto", costs=_calibrated(COSTS))
    tail = simulate(policy, ps, COSTS, 200)[40:]
    assert max(set(tail), key=tail.count) == best_size(ps, COSTS)


def test_runs_of_accepted_drafts_make_long_chains_pay():
    """Requests that copy a whole chain in 30% of their steps and miss the first draft otherwise
    (the way n-gram drafts are accepted): the true rates favour 16 nodes, which one rate for every
    draft (0.68 to 0.82 here) would not see."""
    q, costs = 0.3, {1: 1.0, 2: 1.05, 4: 1.15, 8: 1.4, 16: 2.0}
    rates = {n: (1 + q * (n - 1)) / c for n, c in costs.items()}
    assert max(rates, key=rates.get) == 16 and rates[16] > 1.05 * rates[8]
    geometric = {n: expected(0.82, n - 1) / c for n, c in costs.items()}
    assert max(geometric, key=geometric.get) < 16
    policy = SpecPolicy(16, "auto", costs=_calibrated(costs))
    rng = random.Random(0)
    records = [Acceptance() for _ in range(4)]
    chosen = []
    for _ in range(200):
        n = policy.choose(8, records)
        chosen.append(n)
        for record in records:
            record.add(n - 1, n - 1 if rng.random() < q else 0)
    tail = chosen[40:]
    assert max(set(tail), key=tail.count) == 16


def test_nothing_pays_so_plain_steps_with_thinning_probes():
    policy = SpecPolicy(8, "auto", probe_every=4, costs=_calibrated(COSTS))
    chosen = simulate(policy, [0.0] * 4, COSTS, 300)
    # The first steps speculate on the prior of one half, then plain steps and probes of two nodes.
    probes = [i for i, n in enumerate(chosen) if n > 1 and i > 10]
    assert set(chosen[10:]) <= {1, 2} and chosen[10:].count(1) > 0.9 * len(chosen[10:])
    assert len(probes) < 0.05 * len(chosen)
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert gaps == sorted(gaps) and gaps[-1] == 8 * 4 + 1


def test_unknown_costs_start_plain_and_are_tried_once():
    """With no calibration the first step is plain; a larger size is then guessed to cost what
    the size below it cost, tried, and its measured cost decides from then on."""
    costs = {1: 1.0, 2: 1.05, 4: 3.0, 8: 9.0}
    policy = SpecPolicy(8, "auto")
    chosen = simulate(policy, [0.7] * 4, costs, 60)
    assert chosen[0] == 1
    assert policy.chosen[8] <= 2 and policy.chosen[4] <= 2
    assert max(set(chosen[20:]), key=chosen[20:].count) == best_size([0.7] * 4, costs) == 2


def test_speculation_must_beat_plain_by_the_margin():
    # Four nodes promise 3% more than plain: within the 5% margin, so plain runs; without a
    # margin, four nodes. Among speculative sizes the best one wins, however close the next.
    requests = [_fixed(0.8)]
    gain = expected(0.8, 3)
    costs = _calibrated({1: 1.0, 2: 9.0, 4: gain / 1.03, 8: 9.0})
    assert SpecPolicy(8, "auto", costs=costs).peek(8, requests) == 1
    assert SpecPolicy(8, "auto", margin=0.0, costs=costs).peek(8, requests) == 4
    close = _calibrated({1: 1.0, 2: 1.0, 4: 1.0, 8: expected(0.8, 7) / expected(0.8, 3) / 1.01})
    assert SpecPolicy(8, "auto", costs=close).peek(8, requests) == 8


def test_match_classes():
    assert [match_class(n) for n in (0, 1, 2, 3, 4, 7, 8, 17)] == [None, 0, 1, 2, 3, 3, 4, 4]
    assert len(MATCH_CLASSES) == 5
    NO_DRAFTS.add(3, 3)
    assert NO_DRAFTS.p_first == 0.0 and NO_DRAFTS.expected_tokens(15) == 1.0


def test_drafts_are_scored_by_their_match_length():
    """The same four requests draft after long matches (8 tokens: each next draft accepted with
    probability 0.95) on even steps and after 1-token ones (0.1) on odd steps. Scored by match
    length, the policy runs the best size after long matches and plain steps after short ones,
    the brute-force answer for each; scored by request, both kinds of step share one
    estimate. A new request then starts from what the others measured; one that matches nothing
    runs plain."""
    rng = random.Random(0)
    requests = [SimpleNamespace(rid=str(i), seq_len=100) for i in range(4)]
    top = best_size([0.95] * 4, COSTS)
    assert top > 1 and best_size([0.1] * 4, COSTS) == 1
    for by_match in (True, False):
        policy = SpecPolicy(16, "auto", costs=_calibrated(COSTS), buckets=(8,))
        chosen = []
        for step in range(300):
            length, p = (8, 0.95) if step % 2 == 0 else (1, 0.1)
            bucket, records, context = policy.batch(requests, [length] * 4 if by_match else None)
            n = policy.choose(bucket, records, context)
            chosen.append(n)
            for record in records:
                accepted = 0
                while accepted < n - 1 and rng.random() < p:
                    accepted += 1
                record.add(n - 1, accepted)
        long, short = chosen[100::2], chosen[101::2]
        if by_match:
            assert set(long) == {top} and short.count(1) > 0.9 * len(short)
            assert not policy.records
        else:
            assert max(set(long), key=long.count) == max(set(short), key=short.count) > 1
    policy.forget()
    assert all(record.first == [0.0, 0.0] for record in policy.by_match)
    newcomer = [SimpleNamespace(rid="new", seq_len=100)]
    policy = SpecPolicy(16, "auto", costs=_calibrated(COSTS), buckets=(8,))
    policy.by_match[match_class(8)].first = [95.0, 5.0]
    policy.by_match[match_class(8)].later = [95.0, 5.0]
    assert policy.peek(*policy.batch(newcomer, [8])) == top
    assert policy.peek(*policy.batch(newcomer, [0])) == 1


def test_peek_changes_nothing():
    policy = SpecPolicy(8, "auto", costs=_calibrated(COSTS))
    requests = [_fixed(0.9)]
    first = policy.peek(8, requests)
    assert [policy.peek(8, requests) for _ in range(5)] == [first] * 5
    assert sum(policy.chosen.values()) == 0
    assert policy.choose(8, requests) == first


def test_step_costs_take_the_median_of_what_serving_measures():
    costs = StepCosts(window=5)
    costs.add(4, 2, 0.5)
    assert costs.measured(4, 2) == 0.5 and costs.measured(4, 4) is None
    assert costs.estimate(4, 4, [1, 2, 4]) == 0.5 and costs.estimate(8, 4, [1, 2, 4]) is None
    for seconds in (0.1, 0.1, 9.0, 0.1, 0.1):  # one stalled step
        costs.add(4, 2, seconds)
    assert costs.measured(4, 2) == 0.1
    costs.add(4, 2, 0.0)  # no clean sample
    assert costs.measured(4, 2) == 0.1


def test_measured_steps_shift_every_calibrated_size_of_their_bucket():
    """Steps of one size move the cost of every calibrated size of the bucket by the median of
    measured minus calibrated seconds, so a size that has not run lately does not look cheap."""
    costs = _calibrated({1: 1.0, 2: 1.1, 4: 1.3, 8: 2.0})
    for seconds in (1.5, 1.5, 9.0, 1.5):  # 4 nodes measured 0.2 s dearer, one stalled step
        costs.add(8, 4, seconds)
    assert costs.table()["8"] == pytest.approx({"1": 1.2, "2": 1.3, "4": 1.5, "8": 2.2})
    assert costs.measured(16, 4) is None  # another bucket keeps nothing of it
    for _ in range(5):
        costs.add(8, 1, 0.01)  # far faster than calibrated: never below a tenth of calibration
    assert costs.measured(8, 1) == pytest.approx(0.1)
    policy = SpecPolicy(8, "auto", costs=_calibrated(COSTS))
    chosen = simulate(policy, [0.0] * 4, {n: c + 0.5 for n, c in COSTS.items()}, 40)
    assert chosen[-20:].count(1) >= 19


def test_calibrations_at_two_contexts_give_the_cost_at_any():
    """Between the calibrated contexts a size costs the straight line through them, and past them
    the line goes on; the offset serving measures is taken at each step's own context."""
    costs = StepCosts()
    costs.calibrate(8, 16, 1.0, context=256)
    costs.calibrate(8, 16, 2.0, context=1024)
    assert costs.measured(8, 16, 640) == pytest.approx(1.5)
    assert costs.measured(8, 16, 2048) == pytest.approx(3.0 + 1 / 3)
    assert costs.measured(8, 16, 0) == pytest.approx(1.0 - 1 / 3)
    costs.add(8, 16, 2.5, context=1024)  # 0.5 s dearer than calibrated there
    assert costs.measured(8, 16, 256) == pytest.approx(1.5)
    # Costs that grow with nodes times keys (tree attention), calibrated at two contexts: at each
    # context the policy picks what brute force over the true line picks, and a longer context
    # picks a smaller tree.
    line = {n: (lambda L, n=n: 1.0 + 2e-5 * n * L) for n in tree_sizes(16)}
    costs = StepCosts()
    for n, cost in line.items():
        for L in (256, 1024):
            costs.calibrate(8, n, cost(L), context=L)
    policy = SpecPolicy(16, "auto", costs=costs)
    requests = [_fixed(0.8)] * 4
    picks = {L: policy.peek(8, requests, context=L) for L in (128, 640, 4096)}
    assert picks == {L: best_size([0.8] * 4, {n: cost(L) for n, cost in line.items()}) for L in picks}
    assert picks[128] > picks[4096]


def test_where_the_host_sets_the_pace_every_size_costs_its_time():
    """A step lasts as long as the slower of the device and the host: with the host's work per
    step above every calibrated size, all sizes cost the same and the largest tree wins; once the
    host is quick again, the calibrated differences decide."""
    costs = _calibrated(COSTS)
    policy = SpecPolicy(16, "auto", costs=costs)
    requests = [_fixed(0.9)] * 4
    assert policy.peek(8, requests) == best_size([0.9] * 4, COSTS) < 16
    for _ in range(5):
        policy.observe(8, 4, 3.0, host=3.0)  # the host takes 3 s a step, the device 1.15 s
    assert costs.table()["8"] == pytest.approx({str(n): 3.0 for n in COSTS})
    assert policy.peek(8, requests) == 16
    for _ in range(5):
        policy.observe(8, 4, COSTS[4], host=0.2)
    assert costs.table()["8"] == pytest.approx({str(n): c for n, c in COSTS.items()})
    assert policy.peek(8, requests) == best_size([0.9] * 4, COSTS)


def test_costs_are_kept_per_bucket():
    costs = _calibrated({1: 1.0, 2: 1.05, 4: 1.1, 8: 1.2})
    for n, seconds in {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0}.items():
        costs.calibrate(64, n, seconds)  # a large batch where every node costs a row
    policy = SpecPolicy(8, "auto", costs=costs)
    requests = [_fixed(0.8)] * 4
    assert policy.peek(8, requests) == 8 and policy.peek(64, requests) == 1


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        SpecPolicy(8, "sometimes")
    with pytest.raises(ValueError, match="margin"):
        SpecPolicy(8, "auto", margin=-1)
    with pytest.raises(ValueError, match="match_decay"):
        SpecPolicy(8, "auto", match_decay=0)


def _calibrated(costs: dict[int, float], bucket: int = 8) -> StepCosts:
    known = StepCosts()
    for n, seconds in costs.items():
        known.calibrate(bucket, n, seconds)
    return known


def _fixed(p: float) -> Acceptance:
    """A record whose estimates are both ``p`` (no decay)."""
    record = Acceptance(decay=1.0)
    record.first = [p * 1000 - 0.5, (1 - p) * 1000 - 0.5]
    record.later = list(record.first)
    return record

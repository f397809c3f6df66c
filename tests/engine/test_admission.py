"""The admission gate: its cost fit and its ski-rental rule on known costs (the engine with it:
``test_engine.py``)."""

from __future__ import annotations

import math

import pytest

from ngram_hal.engine.admission import PATIENCE, WINDOW, AdmissionGate, PrefillCosts


def known(fixed_s: float) -> PrefillCosts:
    """Prefill steps whose fixed part is ``fixed_s``: two sizes at the same cost."""
    costs = PrefillCosts()
    costs.observe(1, fixed_s)
    costs.observe(2, fixed_s)
    return costs


def test_the_fit_recovers_a_lines_intercept():
    costs = PrefillCosts()
    for tokens in (16, 40, 512, 700, 1024):
        costs.observe(tokens, 0.002 + 1e-6 * tokens)
    assert costs.fixed_s == pytest.approx(0.002)


def test_the_fit_is_zero_until_two_sizes_were_seen():
    costs = PrefillCosts()
    assert costs.fixed_s == 0.0
    costs.observe(100, 0.5)
    costs.observe(100, 0.7)
    assert costs.fixed_s == 0.0
    costs.observe(300, 0.9)
    assert costs.fixed_s > 0.0


def test_the_fixed_part_lies_between_zero_and_the_shortest_step():
    falling = PrefillCosts()  # longer prompts faster: the line's intercept exceeds every step
    falling.observe(10, 0.9)
    falling.observe(1000, 0.1)
    assert falling.fixed_s == pytest.approx(0.1)
    proportional = PrefillCosts()  # no fixed part: the line's intercept is below zero
    proportional.observe(10, 0.0)
    proportional.observe(1000, 1.0)
    assert proportional.fixed_s == 0.0


def test_the_fit_keeps_the_recent_window():
    costs = PrefillCosts()
    for i in range(WINDOW):
        costs.observe(10 + i, 5.0)  # an old regime: 5 s whatever the size
    for i in range(WINDOW):
        costs.observe(10 + 10 * i, 0.001 + 1e-6 * (10 + 10 * i))
    assert costs.fixed_s == pytest.approx(0.001)


@pytest.mark.parametrize("tokens,seconds", [(0, 1.0), (-3, 1.0), (5, -0.1)])
def test_a_bad_observation_is_refused(tokens, seconds):
    costs = PrefillCosts()
    with pytest.raises(ValueError, match="prefill step"):
        costs.observe(tokens, seconds)
    assert costs.fixed_s == 0.0


@pytest.mark.parametrize("fixed,decode,seats,max_running", [(1.0, 0.5, 1, 4), (2e-3, 1.35e-3, 1, 16),
                                                            (2e-3, 1.35e-3, 3, 16), (5.0, 1.0, 2, 3)])
def test_requests_wait_until_the_idle_seats_cost_a_share_of_a_prefills_fixed_part(fixed, decode, seats, max_running):
    gate = AdmissionGate(max_running, most=None, costs=known(fixed))
    gate.observe_decode(decode)
    waiting, running = seats + 1, max_running - seats  # one more waits than seats are free
    held = 0
    while not gate.ready(waiting, seats, running):
        held += 1
    assert held == math.ceil(PATIENCE * fixed / (decode * seats / max_running) - 1e-9)
    assert gate.idle_s == 0.0, "an admission starts the count again"


def test_requests_are_admitted_at_once_where_waiting_cannot_gather_more():
    gate = AdmissionGate(16, most=4, costs=known(1e9))
    gate.observe_decode(1e-3)
    assert gate.ready(waiting=5, free=2, running=0), "nothing runs: no step to stall"
    assert gate.ready(waiting=2, free=3, running=13), "every waiting request fits"
    assert gate.ready(waiting=9, free=4, running=12), "the free seats fill the largest prefill"
    assert not gate.ready(waiting=9, free=3, running=13)
    assert not gate.ready(waiting=9, free=0, running=16)
    assert not gate.ready(waiting=0, free=3, running=13)


def test_no_seat_or_no_request_adds_no_idle_time():
    gate = AdmissionGate(8, most=None, costs=known(1.0))
    gate.observe_decode(0.1)
    gate.ready(waiting=3, free=0, running=8)
    gate.ready(waiting=0, free=2, running=6)
    assert gate.idle_s == 0.0
    gate.ready(waiting=3, free=2, running=6)
    assert gate.idle_s == pytest.approx(0.1 * 2 / 8)


def test_an_unknown_fixed_part_or_decode_step_admits_at_once():
    gate = AdmissionGate(8, most=None)
    gate.observe_decode(0.1)
    assert gate.ready(waiting=5, free=1, running=7)
    untimed = AdmissionGate(8, most=None, costs=known(1.0))
    assert untimed.ready(waiting=5, free=1, running=7)

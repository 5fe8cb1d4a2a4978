"""The adaptive throttle (SRE book client-side throttling), on a fake clock and a seeded RNG."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.model import ThrottlePolicy
from sidecar.retry.throttle import Throttle

POLICY = ThrottlePolicy(k=2.0, window=2.0, min_requests=20)


def fill(t: Throttle, now: float, requests: int, accepts: int) -> None:
    for i in range(requests):
        t.record(now, accepted=i < accepts)


def test_healthy_upstream_is_never_throttled():
    t = Throttle(POLICY)
    fill(t, 10.0, 100, 100)
    assert t.probability(10.0) == 0.0
    rng = random.Random(1)
    assert all(t.allow(10.0, rng) for _ in range(1000))
    assert t.refused == 0


@pytest.mark.parametrize(
    ("requests", "accepts", "expected"),
    [
        (100, 50, 0.0),  # exactly 1/k accepted: nothing refused
        (100, 40, 20 / 101),  # the formula: (100 - 2*40) / (100 + 1)
        (100, 30, 40 / 101),
        (100, 6, 88 / 101),
        (100, 5, 1.0),  # down (5% or less accepted): every extra attempt refused
        (100, 0, 1.0),
    ],
)
def test_probability_is_the_sre_formula(requests, accepts, expected):
    t = Throttle(POLICY)
    fill(t, 5.0, requests, accepts)
    assert t.probability(5.0) == pytest.approx(expected)


def test_refusals_follow_the_probability_with_a_seeded_rng():
    t = Throttle(POLICY)
    fill(t, 5.0, 100, 30)  # p = 40/101
    rng = random.Random(42)
    allowed = sum(t.allow(5.0, rng) for _ in range(10_000))
    assert abs(allowed / 10_000 - (1 - 40 / 101)) < 0.02
    assert t.refused == 10_000 - allowed


def test_below_min_requests_nothing_is_refused():
    t = Throttle(POLICY)
    fill(t, 1.0, 19, 0)
    assert t.probability(1.0) == 0.0
    t.record(1.0, accepted=False)
    assert t.probability(1.0) == 1.0


def test_the_window_forgets():
    t = Throttle(POLICY)
    fill(t, 1.0, 100, 0)
    assert t.probability(1.5) > 0.9
    assert t.probability(3.5) == 0.0  # two seconds later the outage is out of the window
    assert t.counts(3.5) == (0, 0)


def test_disabled_allows_everything():
    t = Throttle(ThrottlePolicy(enabled=False))
    fill(t, 1.0, 100, 0)
    rng = random.Random(0)
    assert all(t.allow(1.0, rng) for _ in range(100))


def test_down_means_almost_nothing_accepted():
    t = Throttle(POLICY)
    fill(t, 1.0, 100, 5)
    assert t.down(1.0)
    t2 = Throttle(POLICY)
    fill(t2, 1.0, 100, 6)
    assert not t2.down(1.0)
    t3 = Throttle(POLICY)
    fill(t3, 1.0, 10, 0)
    assert not t3.down(1.0)  # too few attempts to say


def test_reload_with_another_window_starts_a_new_one():
    t = Throttle(POLICY)
    fill(t, 1.0, 100, 0)
    t.update_policy(ThrottlePolicy(window=5.0))
    assert t.counts(1.0) == (0, 0)


@given(
    st.integers(min_value=0, max_value=5000),
    st.integers(min_value=0, max_value=5000),
    st.floats(min_value=1.0, max_value=10.0),
)
def test_probability_is_a_probability_and_zero_when_enough_is_accepted(n, a, k):
    accepts = min(a, n)
    t = Throttle(ThrottlePolicy(k=k, min_requests=0))
    fill(t, 1.0, n, accepts)
    p = t.probability(1.0)
    assert 0.0 <= p <= 1.0
    if k * accepts >= n:
        assert p == 0.0
    if p == 1.0:
        assert t.down(1.0)


def test_the_open_breaker_keeps_the_throttle_down_so_no_half_open_ramp_starts_with_retries():
    """A full outage on a fake clock, one sequence every 2 ms, through the route's real breaker,
    throttle and budget: every attempt fails, each sequence ends with the verdict the engine
    would give it. The sequences the open breaker refuses count for the throttle as requests
    not accepted, so its window still says "down" when a half-open ramp starts: once the
    breaker has opened, no sequence makes a retry, and each one it lets through costs exactly
    one call. (Before, a breaker open longer than the throttle's 1 s window left that window
    empty, below ``min_requests``: every ramp began with retries allowed.)"""
    from sidecar.config.parse import parse_text
    from sidecar.core import Fate
    from sidecar.engine.routestate import RouteState
    from sidecar.retry.breaker import Admitted, State
    from sidecar.retry.classify import CUT_SHORT, verdict

    config = parse_text("version: 1\nroutes:\n  - {name: r, upstream: 'http://127.0.0.1:1'}\n")
    route = config.routes[0]
    st = RouteState(route, None)
    rng = random.Random(16)
    opened = False
    half_open_periods = 0
    let_through_after_open = calls_after_open = 0
    onset_retries = 0
    for i in range(30_000):  # 60 s of a full outage
        now = i * 0.002
        was_half_open = st.breaker.state is State.HALF_OPEN
        admission = st.admit(now)
        if st.breaker.state is State.HALF_OPEN and not was_half_open:
            half_open_periods += 1
        if not isinstance(admission, Admitted):
            opened = True
            continue
        st.budget.record_request(now)
        fate, calls = Fate.EXHAUSTED, 0
        for attempt in range(1, route.retry.attempts + 1):
            if attempt > 1:
                if not st.throttle.allow(now, rng):
                    fate = Fate.THROTTLED
                    break
                if not st.budget.try_retry(now):
                    fate = Fate.BUDGET_EXHAUSTED
                    break
                if not opened:
                    onset_retries += 1
            calls += 1
            st.throttle.record(now, accepted=False)  # 503
        down = fate in CUT_SHORT and st.throttle.down(now)
        v = verdict(route.retry, 503, None, False, fate, down)
        st.breaker.record(now, v, admission.probe, None, admission.period)
        if opened:
            let_through_after_open += 1
            calls_after_open += calls
    assert opened and half_open_periods >= 4  # the breaker cycled through several ramps
    assert let_through_after_open > 0
    assert calls_after_open == let_through_after_open  # one call each: no retry in any ramp
    # The onset, before the window holds min_requests attempts, is the throttle's design.
    assert onset_retries < route.throttle.min_requests

"""The breaker for "down": a state machine on a fake clock, no I/O, no RNG."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config.model import BreakerPolicy
from sidecar.core import Verdict
from sidecar.retry.breaker import (
    _LEGAL,
    Admitted,
    Breaker,
    IllegalBreakerTransition,
    Rejected,
    State,
)

POLICY = BreakerPolicy(
    failure_ratio=0.5,
    min_sequences=4,
    window=10.0,
    open_for=1.0,
    max_open_for=8.0,
    half_open_probes=2,
    ramp=1.0,
)


def test_opens_on_failure_ratio_only_after_min_sequences():
    b = Breaker(POLICY)
    for t in range(3):
        assert b.admit(t) == Admitted(False)
        b.record(t, Verdict.FAILURE, probe=False)
    assert b.state is State.CLOSED  # 3 < min_sequences
    b.record(3.0, Verdict.FAILURE, probe=False)
    assert b.state is State.OPEN and b.opened_at == 3.0


def test_ratio_below_threshold_stays_closed():
    b = Breaker(POLICY)
    for i in range(10):
        b.record(float(i) / 10, Verdict.SUCCESS if i % 4 != 0 else Verdict.FAILURE, probe=False)
    assert b.state is State.CLOSED
    assert b.counts(1.0) == (10, 3)


def test_neutral_verdicts_count_nowhere():
    b = Breaker(POLICY)
    for i in range(50):
        b.record(i / 10, Verdict.NEUTRAL, probe=False)
    assert b.counts(5.0) == (0, 0) and b.state is State.CLOSED


def test_old_sequences_leave_the_window():
    b = Breaker(POLICY)
    for i in range(3):
        b.record(float(i), Verdict.FAILURE, probe=False)
    # 20 s later the three failures are out of the 10 s window.
    b.record(25.0, Verdict.FAILURE, probe=False)
    assert b.state is State.CLOSED
    assert b.counts(25.0) == (1, 1)


def open_breaker(at: float = 0.0) -> Breaker:
    b = Breaker(POLICY)
    for i in range(4):
        b.record(at + i / 100, Verdict.FAILURE, probe=False)
    assert b.state is State.OPEN
    return b


def test_open_rejects_with_time_until_half_open():
    b = open_breaker()
    r = b.admit(0.53)
    assert isinstance(r, Rejected) and r.retry_after == pytest.approx(0.5)
    assert b.open_period == 1.0


def fail_probes(b: Breaker, now: float) -> float:
    """Let the half-open ramp admit probes until they reopen the breaker; return when."""
    assert b.state is State.OPEN
    b.admit(now)
    assert b.state is State.HALF_OPEN
    while b.state is not State.OPEN:
        a = b.admit(now)
        if isinstance(a, Admitted):
            assert a.probe
            b.record(now, Verdict.FAILURE, probe=True)
        now += 0.01
    return now


def test_open_period_doubles_on_each_reopen_up_to_max_and_resets_on_close():
    b = open_breaker()
    periods = [b.open_period]
    now = 0.03
    for _ in range(5):
        assert b.opened_at is not None
        now = b.opened_at + b.open_period
        now = fail_probes(b, now)
        periods.append(b.open_period)
    assert periods == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    # Recovery: the ramp closes it, and the next outage starts from open_for again.
    assert b.opened_at is not None
    now = b.opened_at + b.open_period
    while b.state is not State.CLOSED:
        if isinstance(b.admit(now), Admitted):
            b.record(now, Verdict.SUCCESS, probe=True)
        now += 0.01
    assert b.open_period == 1.0
    for i in range(4):
        b.record(now + i / 100, Verdict.FAILURE, probe=False)
    assert b.state is State.OPEN and b.open_period == 1.0


def test_half_open_ramps_the_admitted_share_linearly():
    b = open_breaker()
    t0 = 1.03
    admitted = []
    for i in range(200):  # a request every 10 ms for 2 s
        now = t0 + i * 0.01
        if isinstance(b.admit(now), Admitted):
            admitted.append(now)
            b.record(now, Verdict.NEUTRAL, probe=True)  # neither decides
    assert admitted[0] == t0  # the first sequence after the open period goes through
    first_half = sum(1 for t in admitted if t < t0 + 0.5)
    ramp = sum(1 for t in admitted if t < t0 + 1.0)
    after = sum(1 for t in admitted if t >= t0 + 1.0)
    # The share grows from 0 to 1 over the ramp: about a quarter of the first half second,
    # half of the ramp, then everything.
    assert 12 <= first_half <= 14
    assert 50 <= ramp <= 52
    assert after == 100


def test_half_open_closes_only_after_the_ramp_with_enough_judged():
    seen = []
    b = open_breaker()
    b._on_transition = lambda f, t: seen.append((f, t))
    now = 1.03
    while now < 1.03 + 0.9:
        if isinstance(b.admit(now), Admitted):
            b.record(now, Verdict.SUCCESS, probe=True)
        now += 0.01
    assert b.state is State.HALF_OPEN  # every probe succeeded, but the ramp is not over
    while b.state is State.HALF_OPEN:
        if isinstance(b.admit(now), Admitted):
            b.record(now, Verdict.SUCCESS, probe=True)
        now += 0.01
    assert b.state is State.CLOSED and now < 1.03 + 1.05
    assert seen == [(State.OPEN, State.HALF_OPEN), (State.HALF_OPEN, State.CLOSED)]
    assert b.counts(now) == (0, 0)


def test_half_open_tolerates_failures_below_the_ratio():
    b = open_breaker()
    now, n = 1.03, 0
    while b.state is State.HALF_OPEN or n == 0:
        if isinstance(b.admit(now), Admitted):
            n += 1
            b.record(now, Verdict.FAILURE if n % 3 == 0 else Verdict.SUCCESS, probe=True)
        now += 0.01
    assert b.state is State.CLOSED  # a third failing is "degraded", not "down"


def test_half_open_reopens_when_failures_reach_the_ratio():
    b = open_breaker()
    b.admit(1.03)
    b.record(1.04, Verdict.FAILURE, probe=True)
    # 1 failure >= 0.5 x max(1 judged, 2 half_open_probes): already half of them.
    assert b.state is State.OPEN and b.open_period == 2.0
    b2 = Breaker(BreakerPolicy(failure_ratio=0.5, min_sequences=4, half_open_probes=3))
    for i in range(4):
        b2.record(i / 100, Verdict.FAILURE, probe=False)
    b2.admit(5.0)
    b2.record(5.0, Verdict.FAILURE, probe=True)
    assert b2.state is State.HALF_OPEN  # 1 < 0.5 * 3
    now = 5.0
    while b2.state is State.HALF_OPEN:
        now += 0.01
        if isinstance(b2.admit(now), Admitted):
            b2.record(now, Verdict.FAILURE, probe=True)
    assert b2.state is State.OPEN and b2.open_period == 2.0


def test_sequences_admitted_before_opening_have_no_say_afterwards():
    b = open_breaker()
    b.record(0.5, Verdict.SUCCESS, probe=False)
    assert b.state is State.OPEN
    b.admit(2.0)
    b.record(2.0, Verdict.SUCCESS, probe=False)
    assert b.state is State.HALF_OPEN


def test_disabled_breaker_admits_everything_and_never_opens():
    b = Breaker(BreakerPolicy(enabled=False, min_sequences=1))
    for i in range(100):
        assert b.admit(i) == Admitted(False)
        b.record(i, Verdict.FAILURE, probe=False)
    assert b.state is State.CLOSED


def test_switching_it_off_by_reload_closes_an_open_breaker():
    seen = []
    b = open_breaker()
    b._on_transition = lambda f, t: seen.append((f, t))
    b.update_policy(BreakerPolicy(enabled=False))
    assert b.state is State.CLOSED
    assert seen == [(State.OPEN, State.HALF_OPEN), (State.HALF_OPEN, State.CLOSED)]


def test_illegal_transitions_raise():
    b = Breaker(POLICY)
    with pytest.raises(IllegalBreakerTransition):
        b._go(State.HALF_OPEN, 0.0)
    with pytest.raises(IllegalBreakerTransition):
        b._go(State.CLOSED, 0.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(min_value=0.0, max_value=0.5),
            st.sampled_from([Verdict.SUCCESS, Verdict.FAILURE, Verdict.NEUTRAL]),
        ),
        max_size=300,
    )
)
def test_any_traffic_takes_only_legal_transitions_and_ramps_within_its_share(steps):
    seen: list[tuple[State, State]] = []
    b = Breaker(POLICY, lambda f, t: seen.append((f, t)))
    now = 0.0
    ramp_start: float | None = None
    ramp_admitted = 0
    for gap, v in steps:
        now += gap
        was = b.state
        a = b.admit(now)
        if b.state is State.HALF_OPEN and was is State.OPEN:
            ramp_start, ramp_admitted = now, 0
        if isinstance(a, Admitted):
            if b.state is State.HALF_OPEN:
                ramp_admitted += 1
                assert ramp_start is not None
                # The ramp admits the first one, then never more than its share.
                assert ramp_admitted <= 1 + (now - ramp_start) / POLICY.ramp * ramp_admitted + 1
            b.record(now, v, a.probe)
        else:
            assert b.state is not State.CLOSED
            assert a.retry_after >= 0
        assert b.open_period <= POLICY.max_open_for
    assert all(t in _LEGAL for t in seen)

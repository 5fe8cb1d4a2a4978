"""Breaker and budget state machines with a fake clock; no I/O."""

import pytest

from sidecar.admin.killswitch import KillSwitch
from sidecar.config.model import BreakerPolicy, BudgetPolicy
from sidecar.core import Verdict
from sidecar.retry.breaker import Admitted, Breaker, IllegalTransition, Rejected, State
from sidecar.retry.budget import Budget
from sidecar.retry.window import Window

POLICY = BreakerPolicy(
    failure_ratio=0.5, min_sequences=4, window=10.0, open_for=30.0, half_open_probes=2
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


def test_old_sequences_leave_the_window():
    b = Breaker(POLICY)
    for i in range(3):
        b.record(float(i), Verdict.FAILURE, probe=False)
    # 20 s later the three failures are out of the 10 s window.
    b.record(25.0, Verdict.FAILURE, probe=False)
    assert b.state is State.CLOSED
    assert b.counts(25.0) == (1, 1)


def open_breaker() -> Breaker:
    b = Breaker(POLICY)
    for i in range(4):
        b.record(float(i), Verdict.FAILURE, probe=False)
    assert b.state is State.OPEN
    return b


def test_open_rejects_with_time_until_probe():
    b = open_breaker()
    r = b.admit(13.0)
    assert isinstance(r, Rejected) and r.retry_after == pytest.approx(20.0)


def test_half_open_lets_n_probes_through_then_closes_on_their_success():
    seen = []
    b = open_breaker()
    b._on_transition = lambda f, t: seen.append((f, t))
    assert b.admit(33.0) == Admitted(True, period=1)
    assert b.state is State.HALF_OPEN
    assert b.admit(33.1) == Admitted(True, period=1)
    assert isinstance(b.admit(33.2), Rejected)  # both probe slots taken
    b.record(33.5, Verdict.SUCCESS, probe=True)
    assert b.state is State.HALF_OPEN
    b.record(33.6, Verdict.SUCCESS, probe=True)
    assert b.state is State.CLOSED
    assert seen == [(State.OPEN, State.HALF_OPEN), (State.HALF_OPEN, State.CLOSED)]
    assert b.counts(34.0) == (0, 0)


def test_half_open_reopens_on_a_failed_probe():
    b = open_breaker()
    b.admit(40.0)
    b.record(40.5, Verdict.FAILURE, probe=True)
    assert b.state is State.OPEN and b.opened_at == 40.5


def test_sequences_admitted_before_opening_have_no_say_afterwards():
    b = open_breaker()
    b.record(5.0, Verdict.SUCCESS, probe=False)
    assert b.state is State.OPEN
    b.admit(40.0)
    b.record(40.1, Verdict.SUCCESS, probe=False)
    assert b.state is State.HALF_OPEN


def test_illegal_transitions_raise():
    b = Breaker(POLICY)
    with pytest.raises(IllegalTransition):
        b._go(State.HALF_OPEN, 0.0)
    with pytest.raises(IllegalTransition):
        b._go(State.CLOSED, 0.0)


def test_budget_allows_ratio_of_requests_plus_floor():
    bud = Budget(BudgetPolicy(ratio=0.2, min_per_second=0.0, window=10.0))
    for i in range(100):
        bud.record_request(i * 0.05)
    allowed = sum(bud.try_retry(5.0) for _ in range(50))
    assert allowed == 20
    assert bud.exhausted == 30


def test_budget_floor_allows_retries_at_low_traffic():
    bud = Budget(BudgetPolicy(ratio=0.2, min_per_second=1.0, window=10.0))
    bud.record_request(0.0)
    # allowed while retries < 0.2 * 1 + 1.0 * 10 = 10.2
    assert sum(bud.try_retry(0.1) for _ in range(20)) == 11


def test_budget_window_slides():
    bud = Budget(BudgetPolicy(ratio=0.5, min_per_second=0.0, window=1.0))
    for _ in range(10):
        bud.record_request(0.0)
    assert sum(bud.try_retry(0.5) for _ in range(10)) == 5
    assert not bud.try_retry(2.0)  # the requests left the window


def test_window_is_constant_memory():
    w = Window(10.0)
    for i in range(100_000):
        w.add(i * 0.001, a=1)
    assert w.totals(99.999) == (10_000, 0)
    assert len(w._a) == 10


def test_kill_switch_scopes_and_expiry():
    k = KillSwitch()
    assert not k.covers("orders", 0.0)
    k.set("route:orders", 60.0, "incident 42", "127.0.0.1", now=0.0, wall=1000.0)
    assert k.covers("orders", 1.0) and not k.covers("users", 1.0)
    k.set("global", 10.0, "all off", "127.0.0.1", now=0.0, wall=1000.0)
    assert k.covers("users", 5.0)
    assert not k.covers("users", 10.0)  # global expired
    assert [s.scope for s in k.active(10.0)] == ["route:orders"]
    assert k.lift("route:orders") and not k.covers("orders", 11.0)
    with pytest.raises(ValueError):
        k.set("global", 86401.0, "too long", "x", 0.0, 0.0)

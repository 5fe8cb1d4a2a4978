"""Budget and window state machines with a fake clock; no I/O (the breaker: test_breaker.py)."""

import pytest

from sidecar.admin.killswitch import KillSwitch
from sidecar.config.model import BudgetPolicy
from sidecar.retry.budget import Budget
from sidecar.retry.window import Window


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


def test_a_retry_not_sent_gives_its_budget_token_back():
    bud = Budget(BudgetPolicy(ratio=0.0, min_per_second=0.1, window=10.0))  # 1 retry per window
    assert bud.try_retry(1.0)
    assert not bud.try_retry(1.5)
    bud.give_back(1.0)  # the retry allowed at 1.0 was not sent
    assert bud.counts(2.0) == (0, 0)
    assert bud.try_retry(2.0)
    bud.give_back(2.0)
    bud.give_back(2.0)  # never below nothing
    assert bud.counts(2.0) == (0, 0)


def test_giving_back_a_token_that_left_the_window_touches_nothing_newer():
    w = Window(1.0)
    w.add(0.05, b=1)
    w.add(1.05, b=1)  # the same slot, a bucket later: the old one left the window
    w.take_back(0.05, b=1)
    assert w.totals(1.05) == (0, 1)

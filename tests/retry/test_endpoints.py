"""Endpoint choice and passive health, on a fake clock."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sidecar.retry.endpoints import EJECT_AFTER, EJECT_BASE, EndpointSet


def three() -> EndpointSet:
    return EndpointSet([("10.0.0.1", 80, "a:80"), ("10.0.0.2", 80, "b:80"), ("10.0.0.3", 80, "")])


def test_round_robin():
    s = three()
    picked = [s.pick(0.0).host for _ in range(6)]
    assert picked == ["10.0.0.1", "10.0.0.2", "10.0.0.3"] * 2
    assert s.endpoints[2].name == "10.0.0.3:80"


def test_a_retry_avoids_the_endpoints_already_used():
    s = three()
    first = s.pick(0.0)
    second = s.pick(0.0, avoid=[first])
    third = s.pick(0.0, avoid=[first, second])
    assert len({first.host, second.host, third.host}) == 3
    # All used: the next in turn after all.
    assert s.pick(0.0, avoid=[first, second, third]) in s.endpoints


def test_ejected_after_consecutive_connection_failures_then_back():
    s = three()
    bad = s.endpoints[0]
    for _ in range(EJECT_AFTER - 1):
        s.report(1.0, bad, connection_failed=True)
    assert not bad.ejected(1.0)
    s.report(1.0, bad, connection_failed=True)
    assert bad.ejected(1.0) and s.healthy(1.0) == 2
    assert all(s.pick(1.5).host != bad.host for _ in range(10))
    assert not bad.ejected(1.0 + EJECT_BASE)  # the ejection ends
    # Failing again right away: ejected twice as long.
    for _ in range(EJECT_AFTER):
        s.report(2.5, bad, connection_failed=True)
    assert bad.ejected(2.5 + 1.9 * EJECT_BASE) and not bad.ejected(2.5 + 2 * EJECT_BASE)
    # Any response clears its record.
    s.report(10.0, bad, connection_failed=False)
    assert bad.failures == 0 and bad.ejections == 0


def test_a_response_between_failures_resets_the_count():
    s = three()
    e = s.endpoints[1]
    for _ in range(10):
        s.report(1.0, e, connection_failed=True)
        s.report(1.0, e, connection_failed=False)
    assert not e.ejected(1.0)


def test_never_without_endpoints_when_all_are_ejected():
    s = three()
    for e in s.endpoints:
        for _ in range(EJECT_AFTER):
            s.report(1.0, e, connection_failed=True)
    assert s.healthy(1.0) == 0
    assert s.pick(1.1) in s.endpoints


def test_a_single_endpoint_is_never_ejected():
    s = EndpointSet([("127.0.0.1", 8080, "")])
    for _ in range(100):
        s.report(1.0, s.endpoints[0], connection_failed=True)
    assert not s.endpoints[0].ejected(1.0)


def test_update_keeps_the_health_of_kept_endpoints():
    s = three()
    for _ in range(EJECT_AFTER):
        s.report(1.0, s.endpoints[0], connection_failed=True)
    s.update([("10.0.0.1", 80, "a:80"), ("10.0.0.9", 80, "z:80")])
    assert [e.host for e in s.endpoints] == ["10.0.0.1", "10.0.0.9"]
    assert s.endpoints[0].ejected(1.0)
    s.update([])  # an empty answer never empties the set
    assert len(s.endpoints) == 2


@given(
    st.lists(
        st.tuples(st.integers(min_value=0, max_value=2), st.booleans(), st.booleans()),
        max_size=200,
    )
)
def test_pick_always_returns_a_member(ops):
    s = three()
    now = 0.0
    for i, failed, avoid in ops:
        now += 0.1
        e = s.endpoints[i]
        s.report(now, e, failed)
        assert s.pick(now, [e] if avoid else []) in s.endpoints

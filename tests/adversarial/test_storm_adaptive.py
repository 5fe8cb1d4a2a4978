"""Adaptive storm control over real sockets: what the breaker counts, the throttle in an
outage, a refusal from a sidecar further down, and the kill switch turning it all off."""

from __future__ import annotations

import time

from aiohttp import web

from sidecar.core import Verdict
from sidecar.retry.breaker import State
from sidecar.testing import FakeClock
from tests.conftest import hang, reply, routes_yaml


def alternating() -> object:
    """503 on odd arrivals, 200 on even ones: a 50% partial failure."""
    n = [0]

    async def h(request: web.Request) -> web.StreamResponse:
        n[0] += 1
        return web.Response(status=503 if n[0] % 2 else 200)

    return h


async def test_sequences_the_budget_cut_short_are_not_evidence_of_down(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(alternating())
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    budget: {ratio: 0, min_per_second: 0}\n"
            "    throttle: {enabled: false}\n"
            "    breaker: {min_sequences: 4, failure_ratio: 0.5}",
        )
    )
    fates: dict[str, int] = {}
    for _ in range(40):
        async with client.get(sc.url + "/x") as resp:
            fates[resp.headers["x-retry-fate"]] = fates.get(resp.headers["x-retry-fate"], 0) + 1
    assert fates == {"success": 20, "budget-exhausted": 20}
    b = sc.sidecar.states.get("main").breaker
    assert b.state is State.CLOSED
    assert b.counts(time.monotonic()) == (20, 0)  # the cut ones told it nothing


async def test_in_a_full_outage_the_throttle_stops_retries_and_the_breaker_opens(
    upstream_factory, sidecar_factory, client
):
    # On the test's (stopped) clock: however slowly the 120 requests run, the breaker's first
    # open period (1 s) cannot run out among them, which would reopen it for 2 s.
    clock = FakeClock()
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(routes_yaml(up.url), clock=clock)
    fates: dict[str, int] = {}
    n = 120
    for _ in range(n):
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 503
            f = resp.headers["x-retry-fate"]
            fates[f] = fates.get(f, 0) + 1
    # The first sequences retried (too few attempts for the throttle to judge), then it
    # refused nearly every retry: the upstream saw about one call per request, and those
    # refused sequences, the upstream being down, counted as failures for the breaker.
    assert fates.get("throttled", 0) > 0
    assert len(up.seen) <= 1.3 * n, (len(up.seen), fates)
    st = sc.sidecar.states.get("main")
    assert st.throttle.down(clock.monotonic())
    assert fates.get("breaker-open", 0) > 0
    assert [t.to for t in sc.recorder.transitions][:1] == ["open"]
    assert st.breaker.open_period == 1.0


async def test_a_refusal_from_a_sidecar_below_is_not_retried_nor_counted(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(
        reply(503, b'{"error": "breaker open"}', {"x-retry-proxy-error": "breaker-open"})
    )
    sc = await sidecar_factory(routes_yaml(up.url, "    breaker: {min_sequences: 1}"))
    for _ in range(5):
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 503
            assert resp.headers["x-retry-fate"] == "breaker-open"
            assert resp.headers["x-retry-attempts"] == "1"
            # The inner tier's answer, relayed: this sidecar did not make it.
            assert "x-retry-proxy-error" not in resp.headers
            assert await resp.read() == b'{"error": "breaker open"}'
    assert len(up.seen) == 5
    st = sc.sidecar.states.get("main")
    assert st.breaker.state is State.CLOSED and st.breaker.counts(time.monotonic()) == (0, 0)


async def test_the_kill_switch_turns_every_adaptive_mechanism_off(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(hang(0.3), reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {auto_timeout: {min: 50ms, max: 100ms}}\n    hedge: {enabled: true}\n"
            "    bulkhead: {adaptive: true}",
        )
    )
    st = sc.sidecar.states.get("main")
    now = time.monotonic()
    st.latency.ran_long(now)  # hedging armed
    # An open breaker and a concurrency limit with no room left...
    for _i in range(30):
        st.breaker.record(now, Verdict.FAILURE, probe=False)
    assert st.breaker.state is State.OPEN
    held = []
    while (t := st.limiter.try_acquire(now)) is not None:
        held.append(t)
        assert len(held) <= 1000, "the adaptive limit never refused"
    try:
        async with client.get(sc.url + "/x") as resp:
            assert resp.headers["x-retry-fate"] == "breaker-open"
        # ...and the kill switch: a plain proxy, one attempt, no hedge though it is slow.
        sc.sidecar.kill.set("route:main", 60, "test", "tester", time.monotonic(), time.time())
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 200
            assert resp.headers["x-retry-attempts"] == "1"
            assert "x-retry-hedges" not in resp.headers
        assert len(up.seen) == 1
    finally:
        for t in held:
            st.limiter.release(time.monotonic(), t, None)
    sc.sidecar.kill.lift("route:main")


async def test_the_concurrency_limit_refuses_at_once_with_its_own_code(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url, "    bulkhead: {adaptive: true}"))
    st = sc.sidecar.states.get("main")
    now = time.monotonic()
    held = []
    while (t := st.limiter.try_acquire(now)) is not None:
        held.append(t)
        assert len(held) <= 1000, "the adaptive limit never refused"
    try:
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 503
            assert resp.headers["x-retry-fate"] == "overloaded"
            assert resp.headers["x-retry-proxy-error"] == "concurrency-limit"
        assert up.seen == []
    finally:
        for t in held:
            st.limiter.release(time.monotonic(), t, None)
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200
    text = sc.sidecar.metrics.render()
    assert 'retry_sidecar_attempts_total{route="main",outcome="concurrency-limit"} 1' in text
    assert 'retry_sidecar_concurrency_limit{route="main"}' in text


async def test_storm_control_state_is_in_the_metrics(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200
    text = sc.sidecar.metrics.render()
    for line in (
        'retry_sidecar_throttle_probability{route="main"} 0',
        'retry_sidecar_concurrency_in_flight{route="main"} 0',
        'retry_sidecar_per_try_timeout_seconds{route="main"} 10',  # auto, cold: its maximum
        'retry_sidecar_breaker_open_seconds{route="main"} 1',
        'retry_sidecar_endpoints{route="main",state="healthy"} 1',
    ):
        assert line in text, line

"""Storm control over real sockets: breaker per sequence, budget, bulkhead, edge-only retries
across three tiers, deadline propagation, kill switch."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from aiohttp import web

from sidecar.testing import FakeClock
from tests.conftest import hang, reply, routes_yaml
from tests.wait import until


async def test_breaker_records_one_event_per_sequence(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(up.url, "    breaker: {min_sequences: 1000}\n    throttle: {enabled: false}")
    )
    for _ in range(5):
        async with client.get(sc.url + "/x") as resp:
            assert resp.headers["x-retry-attempts"] == "3"
    assert len(up.seen) == 15
    breaker = sc.sidecar.states.get("main").breaker
    assert breaker.counts(time.monotonic()) == (5, 5)


async def test_attempt_failures_inside_a_successful_sequence_count_as_success(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503), reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200 and resp.headers["x-retry-attempts"] == "3"
    assert sc.sidecar.states.get("main").breaker.counts(time.monotonic()) == (1, 0)


async def test_open_breaker_answers_503_without_calling_upstream_then_probes(
    upstream_factory, sidecar_factory, client
):
    # The sidecar's clock is the test's: the breaker is certainly still open for the fourth
    # request and certainly past open_for for the probe, however slowly the machine runs.
    clock = FakeClock()
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 2}\n"
            "    breaker: {min_sequences: 3, failure_ratio: 0.5, open_for: 300ms, half_open_probes: 1, ramp: 0s}",
        ),
        clock=clock,
    )
    for _ in range(3):
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 503
    calls = len(up.seen)
    assert calls == 6
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 503
        assert resp.headers["x-retry-fate"] == "breaker-open"
        assert resp.headers["x-retry-proxy-error"] == "breaker-open"
        assert resp.headers["Retry-After"] == "1"
        assert (await resp.json())["attempts"] == 0
    assert len(up.seen) == calls
    # After open_for, one probe goes through; the upstream has recovered, so it closes.
    up.script = [reply(200)]
    clock.advance(0.299)
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "breaker-open"
    assert len(up.seen) == calls
    clock.advance(0.002)
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200
    assert [(t.frm, t.to) for t in sc.recorder.transitions] == [
        ("closed", "open"),
        ("open", "half-open"),
        ("half-open", "closed"),
    ]


async def test_breaker_state_survives_a_reload(upstream_factory, sidecar_factory, client):
    from sidecar.config.parse import parse_text

    up = await upstream_factory(reply(503))
    text = routes_yaml(up.url, "    retry: {attempts: 1}\n    breaker: {min_sequences: 2}")
    sc = await sidecar_factory(text)
    for _ in range(2):
        async with client.get(sc.url + "/x") as resp:
            await resp.read()
    sc.sidecar.apply(parse_text(text.replace("attempts: 1", "attempts: 2"), "<reload>"))
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "breaker-open"


async def test_budget_caps_retries_during_a_full_outage(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    budget: {ratio: 0.2, min_per_second: 0, window: 10s}\n"
            "    throttle: {enabled: false}\n"
            "    breaker: {min_sequences: 100000}",
        ),
        clock=FakeClock(),  # all 200 requests inside one 10 s window, however slow the machine
    )
    n = 200
    fates: dict[str, int] = {}
    for _ in range(n):
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 503  # the last upstream response, as it was
            f = resp.headers["x-retry-fate"]
            fates[f] = fates.get(f, 0) + 1
    retries = len(up.seen) - n
    assert retries <= 0.2 * n + 1, (retries, fates)
    assert fates.get("budget-exhausted", 0) > n // 2
    # Without a budget the same outage would cost 3 calls per request.
    assert len(up.seen) < 1.25 * n


async def test_bulkhead_refuses_past_max_concurrent(upstream_factory, sidecar_factory, client):
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text="late")

    up = await upstream_factory(held)
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 1, per_try_timeout: 5s}\n"
            "    bulkhead: {max_concurrent: 1, queue_timeout: 100ms}",
        )
    )

    async def get() -> tuple[int, str | None]:
        async with client.get(sc.url + "/x") as resp:
            return resp.status, resp.headers.get("x-retry-proxy-error")

    slow = asyncio.create_task(get())
    bulkhead = sc.sidecar.states.get("main").bulkhead
    # The first request holds the only slot (at the upstream, which answers when released).
    await until(lambda: len(up.seen) == 1, "the first request to reach the upstream")
    assert bulkhead.in_flight == 1
    status, code = await get()
    assert (status, code) == (503, "overloaded")
    assert len(up.seen) == 1
    release.set()
    assert (await slow)[0] == 200
    assert sc.sidecar.states.get("main").bulkhead.in_flight == 0


async def test_kill_switch_makes_one_attempt(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(routes_yaml(up.url))
    sc.sidecar.kill.set("route:main", 60, "test", "tester", time.monotonic(), time.time())
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 503
        assert resp.headers["x-retry-fate"] == "kill-switch"
        assert resp.headers["x-retry-attempts"] == "1"
    assert len(up.seen) == 1
    sc.sidecar.kill.lift("route:main")
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-attempts"] == "3"


# -- three tiers ----------------------------------------------------------------------------

PROPAGATED = ("x-retry-edge", "x-request-timeout-ms", "tracestate")


async def start_app(next_url: str) -> web.AppRunner:
    """A tiny app that calls the next tier, forwarding the retry headers as an instrumented
    app would, and answers with the status it got."""

    async def handle(request: web.Request) -> web.Response:
        headers = {h: request.headers[h] for h in PROPAGATED if h in request.headers}
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as s:
            try:
                async with s.get(next_url + request.path, headers=headers) as resp:
                    await resp.read()
                    return web.Response(status=resp.status, text=f"app saw {resp.status}")
            except aiohttp.ClientError:
                return web.Response(status=502)

    app = web.Application()
    app.router.add_get("/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.2)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def three_tiers(upstream_factory, sidecar_factory, bottom, naive: bool, edge_route: str = ""):
    # Naive: the marker ignored (no trusted peers) and no adaptive throttle, i.e. every tier
    # retries on its own as a static retry policy does.
    inner = "    throttle: {enabled: false}" if naive else ""
    tier3 = await sidecar_factory(
        routes_yaml(bottom.url, inner, top_extra='trusted_peers: ["10.0.0.0/8"]' if naive else "")
    )
    app2 = await start_app(tier3.url)
    tier2 = await sidecar_factory(
        routes_yaml(
            f"http://127.0.0.1:{app2.addresses[0][1]}",
            inner,
            top_extra='trusted_peers: ["10.0.0.0/8"]' if naive else "",
        )
    )
    app1 = await start_app(tier2.url)
    edge = await sidecar_factory(
        routes_yaml(f"http://127.0.0.1:{app1.addresses[0][1]}", edge_route or inner)
    )
    return edge, tier2, tier3, [app1, app2]


async def test_full_outage_costs_attempts_not_attempts_cubed(
    upstream_factory, sidecar_factory, client
):
    bottom = await upstream_factory(reply(503))
    edge, _, tier3, apps = await three_tiers(
        upstream_factory,
        sidecar_factory,
        bottom,
        naive=False,
        edge_route="    throttle: {enabled: false}",
    )
    try:
        for _ in range(4):
            async with client.get(edge.url + "/x") as resp:
                assert resp.status == 503
                assert resp.headers["x-retry-attempts"] == "3"
        assert len(bottom.seen) == 4 * 3
        assert {s.header("x-retry-edge") for s in bottom.seen} == {"test-edge"}
        assert {seq.fate for seq in tier3.recorder.sequences} == {"edge-owned"}
    finally:
        for a in apps:
            await a.cleanup()


async def test_naive_tiers_multiply_to_attempts_cubed(upstream_factory, sidecar_factory, client):
    # The same chain with the marker ignored (no trusted peers): the contrast the edge rule fixes.
    bottom = await upstream_factory(reply(503))
    edge, _, _, apps = await three_tiers(upstream_factory, sidecar_factory, bottom, naive=True)
    try:
        async with client.get(edge.url + "/x") as resp:
            assert resp.status == 503
        assert len(bottom.seen) == 27
    finally:
        for a in apps:
            await a.cleanup()


@pytest.mark.slow
async def test_every_tier_gives_up_by_the_edge_deadline(upstream_factory, sidecar_factory, client):
    bottom = await upstream_factory(hang(30.0))
    edge, tier2, tier3, apps = await three_tiers(
        upstream_factory,
        sidecar_factory,
        bottom,
        naive=False,
        edge_route="    timeout: 1s\n    retry: {per_try_timeout: 5s}",
    )
    try:
        started = time.monotonic()
        async with client.get(edge.url + "/x") as resp:
            assert resp.status == 504
            assert resp.headers["x-retry-fate"] == "deadline"
        elapsed = time.monotonic() - started
        assert elapsed < 5.0  # without propagation the inner tiers would wait their own 10 s
        [seen] = bottom.seen
        assert 0 < int(seen.header("x-request-timeout-ms") or 0) <= 1000
        await until(  # the inner tiers end on their own deadline, just after the edge
            lambda: tier2.recorder.sequences and tier3.recorder.sequences,
            "the inner tiers' sequences to end",
        )
        for tier in (tier2, tier3):
            [seq] = tier.recorder.sequences
            assert seq.duration <= 2.5, (tier, seq)  # the edge deadline (1 s), not their 10 s
    finally:
        for a in apps:
            await a.cleanup()

"""Hedged requests and several endpoints per route, over real sockets: the hedge races a slow
attempt, the loser is cancelled and leaves nothing behind, also when the client goes away."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

from aiohttp import web

from sidecar.admin.killswitch import KillSwitch
from sidecar.app import Sidecar
from sidecar.config.model import BudgetPolicy
from sidecar.config.parse import parse_text
from sidecar.core import Clock
from sidecar.engine.attempter import RouteAttempter
from sidecar.engine.attempts import AttemptSet
from sidecar.engine.gate import SequenceGate
from sidecar.engine.loop import Driver
from sidecar.engine.resolve import Resolver
from sidecar.engine.routestate import RouteState
from sidecar.lifecycle import Lifecycle
from sidecar.retry.budget import Budget
from sidecar.retry.concurrency import Ticket
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints
from sidecar.retry.endpoints import EJECT_AFTER, Endpoint
from sidecar.telemetry.events import Recorder
from sidecar.upstream.client import UpstreamResponse
from tests.conftest import hang, reply, routes_yaml
from tests.proc import free_port

# Hedging is opt-in per route: the tests of what it does turn it on.
# A route with everything adaptive on: hedging and the concurrency limit are both opt-in.
FAST_AUTO = (
    "    retry: {auto_timeout: {min: 50ms, max: 100ms}}\n    hedge: {enabled: true}\n"
    "    bulkhead: {adaptive: true}"
)


async def until(cond: Callable[[], bool], limit: float = 5.0) -> None:
    """Wait for ``cond`` (a bound, not a timing assertion: the test fails if it never holds)."""
    end = time.monotonic() + limit
    while not cond():
        assert time.monotonic() < end, "condition never held"
        await asyncio.sleep(0.01)


def armed(sc) -> None:
    """As if an attempt of the route had just run past its per-try timeout: hedging is
    prepared only for routes with a recent tail (see test_the_first_slow_attempt_arms_hedging)."""
    sc.sidecar.states.get("main").latency.ran_long(time.monotonic())


def pools_idle(sc) -> bool:
    return all(p.total == p.idle and p.waiting == 0 for p in sc.sidecar.client.stats().values())


def attempt_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("attempt-")]


async def test_a_slow_attempt_is_hedged_and_the_loser_cancelled(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(hang(5.0), reply(200, b"fast"))
    sc = await sidecar_factory(routes_yaml(up.url, FAST_AUTO))
    armed(sc)
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200 and await resp.read() == b"fast"
        assert resp.headers["x-retry-attempts"] == "2"
        assert resp.headers["x-retry-hedges"] == "1"
        assert resp.headers["x-retry-fate"] == "success"
    assert [s.header("x-retry-attempt") for s in up.seen] == ["1", "2"]
    assert [h.result for h in sc.recorder.hedges] == ["sent", "won"]
    await until(lambda: len(sc.recorder.attempts) == 2)
    assert sorted(a.outcome for a in sc.recorder.attempts) == ["200", "cancelled"]
    # The loser's connection was closed (never pooled mid-response) and nothing is running.
    await until(lambda: pools_idle(sc))
    st = sc.sidecar.states.get("main")
    assert st.limiter.in_flight == 0 and st.bulkhead.in_flight == 0
    assert attempt_tasks() == []


async def test_client_leaving_mid_hedge_gives_everything_back(upstream_factory, sidecar_factory):
    up = await upstream_factory(hang(30.0))
    sc = await sidecar_factory(routes_yaml(up.url, FAST_AUTO))
    armed(sc)
    st = sc.sidecar.states.get("main")
    baseline_tasks = len(asyncio.all_tasks())
    _reader, writer = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    writer.write(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n")
    await writer.drain()
    # Half-way: the original and its hedge are both in flight upstream.
    await until(lambda: len(up.seen) == 2)
    assert st.limiter.in_flight == 2 and st.bulkhead.in_flight == 1
    assert len(attempt_tasks()) == 2
    writer.close()
    await until(lambda: st.bulkhead.in_flight == 0)
    await until(lambda: pools_idle(sc))
    assert st.limiter.in_flight == 0
    await until(lambda: attempt_tasks() == [])
    await until(lambda: len(asyncio.all_tasks()) <= baseline_tasks)
    # One sequence, and it told the breaker nothing: the client left.
    assert st.breaker.counts(time.monotonic()) == (0, 0)
    assert [s.fate for s in sc.recorder.sequences] == ["client-gone"]
    assert sorted(a.outcome for a in sc.recorder.attempts) == ["cancelled", "cancelled"]


async def test_the_deadline_cancels_every_hedge(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(hang(30.0))
    sc = await sidecar_factory(routes_yaml(up.url, "    timeout: 500ms\n" + FAST_AUTO))
    armed(sc)
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 504
        assert resp.headers["x-retry-fate"] == "deadline"
        assert resp.headers["x-retry-attempts"] == "3"  # the original and two hedges
    await until(lambda: pools_idle(sc))
    assert attempt_tasks() == []


async def test_writes_are_not_hedged(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(hang(0.4), reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {non_idempotent: always, auto_timeout: {min: 50ms, max: 100ms}}\n"
            "    hedge: {enabled: true}",
        )
    )
    armed(sc)
    async with client.post(sc.url + "/x", data=b"order", headers={"Idempotency-Key": "k"}) as r:
        assert r.status == 200 and "x-retry-hedges" not in r.headers
        assert r.headers["x-retry-attempts"] == "1"
    assert len(up.seen) == 1


async def test_hedging_is_off_unless_the_route_turns_it_on(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(hang(0.4), reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url, "    retry: {auto_timeout: {min: 50ms, max: 100ms}}")
    )
    armed(sc)
    async with client.get(sc.url + "/x") as r:
        assert r.status == 200 and r.headers["x-retry-attempts"] == "1"
    assert len(up.seen) == 1


async def test_a_route_that_hedges_hedges_only_safe_methods_and_never_a_keyed_request(
    upstream_factory, sidecar_factory, client
):
    """With hedging on, a slow PUT or DELETE, and a GET carrying an Idempotency-Key, are not
    duplicated while in progress (a duplicate answers 404/409/412 and may win); a plain GET is."""
    up = await upstream_factory(hang(0.3))
    sc = await sidecar_factory(routes_yaml(up.url, FAST_AUTO))
    for method, headers in (("PUT", {}), ("DELETE", {}), ("GET", {"Idempotency-Key": "k1"})):
        armed(sc)
        before = len(up.seen)
        async with client.request(method, sc.url + "/x", headers=headers) as r:
            assert r.status == 200 and "x-retry-hedges" not in r.headers, method
            assert r.headers["x-retry-attempts"] == "1"
        assert len(up.seen) == before + 1, method
    armed(sc)
    async with client.get(sc.url + "/x") as r:
        assert r.status == 200 and int(r.headers["x-retry-hedges"]) >= 1


async def test_a_route_may_list_writes_to_hedge(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(hang(5.0), reply(204))
    sc = await sidecar_factory(
        routes_yaml(
            up.url, FAST_AUTO.replace("{enabled: true}", "{enabled: true, methods: [DELETE]}")
        )
    )
    armed(sc)
    async with client.delete(sc.url + "/x") as r:
        assert r.status == 204 and r.headers["x-retry-hedges"] == "1"
    armed(sc)
    async with client.get(sc.url + "/x") as r:  # GET is no longer listed
        assert r.status == 204 and "x-retry-hedges" not in r.headers


def two_upstreams_yaml(a: str, b: str, extra: str = "") -> str:
    return f"""
version: 1
name: test-edge
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0"}}
defaults:
  retry:
    backoff: {{strategy: constant, base: 1ms, max: 1ms}}
routes:
  - name: main
    upstream: ["{a}", "{b}"]
{extra}
"""


async def test_a_hedge_goes_to_the_other_endpoint(upstream_factory, sidecar_factory, client):
    slow = await upstream_factory(hang(5.0))
    fast = await upstream_factory(reply(200, b"B"))
    sc = await sidecar_factory(two_upstreams_yaml(slow.url, fast.url, FAST_AUTO))
    armed(sc)
    async with client.get(sc.url + "/x") as resp:  # round robin starts at the first
        assert await resp.read() == b"B" and resp.headers["x-retry-hedges"] == "1"
    assert [s.header("x-retry-attempt") for s in slow.seen] == ["1"]
    assert [s.header("x-retry-attempt") for s in fast.seen] == ["2"]


async def test_a_retry_goes_to_another_endpoint(upstream_factory, sidecar_factory, client):
    bad = await upstream_factory(reply(503))
    good = await upstream_factory(reply(200))
    # The throttle off: half the attempts fail here by construction, and this is about where
    # the retries go, not how many the throttle allows.
    sc = await sidecar_factory(
        two_upstreams_yaml(bad.url, good.url, "    throttle: {enabled: false}")
    )
    armed(sc)
    for _ in range(10):
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 200
            assert resp.headers["x-retry-attempts"] in ("1", "2")
    # Every 503 was retried on the other endpoint, never on the same one again.
    assert {s.header("x-retry-attempt") for s in bad.seen} == {"1"}
    assert len(bad.seen) + len(good.seen) == 10 + len(bad.seen)


async def test_an_endpoint_that_refuses_connections_is_ejected(
    upstream_factory, sidecar_factory, client
):
    good = await upstream_factory(reply(200))
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    sc = await sidecar_factory(two_upstreams_yaml(closed, good.url))
    armed(sc)
    fates = []
    for _ in range(20):
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 200
            fates.append(int(resp.headers["x-retry-attempts"]))
    failures = sum(n - 1 for n in fates)
    # Each connect failure was retried on the good endpoint; after EJECT_AFTER in a row the
    # closed one is skipped (it may come back once if this test runs slower than its 1 s).
    assert EJECT_AFTER <= failures <= EJECT_AFTER + 2
    st = sc.sidecar.states.get("main")
    assert st.endpoints.ejections >= 1
    metrics = sc.sidecar.metrics.render()
    assert 'retry_sidecar_endpoints{route="main",state="healthy"}' in metrics


async def test_a_host_name_is_every_address_it_resolves_to(client):
    seen: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        host = request.transport.get_extra_info("sockname")[0]  # type: ignore[union-attr]
        seen[host] = seen.get(host, 0) + 1
        return web.Response(text=host)

    port = free_port()
    runners = []
    for ip in ("127.0.0.1", "127.0.0.2"):
        app = web.Application()
        app.router.add_get("/{t:.*}", handler)
        r = web.AppRunner(app, access_log=None)
        await r.setup()
        await web.TCPSite(r, ip, port).start()
        runners.append(r)
    text = two_upstreams_yaml("x", "y").replace(
        'upstream: ["x", "y"]', f'upstream: "http://svc.test:{port}"'
    )
    text = text.replace("defaults:", "upstream_pool: {dns_refresh: 1h}\ndefaults:")
    answers: list[list[str]] = [["127.0.0.1", "127.0.0.2"]]

    async def lookup(host: str, p: int) -> list[str]:
        assert host == "svc.test" and p == port
        if not answers[0]:
            raise OSError("no answer")
        return answers[0]

    config = parse_text(text, "<t>")
    sidecar = Sidecar(config)
    sidecar.resolver = Resolver(sidecar.states, lookup)  # the app's own, with a fake DNS
    await sidecar.start()
    url = f"http://127.0.0.1:{sidecar.proxy_port}/x"
    eps = sidecar.states.get("main").endpoints
    try:
        await until(lambda: len(eps.endpoints) == 2)  # resolved by the dns-refresh task
        assert "dns-refresh" in sidecar.task_names()
        for _ in range(6):
            async with client.get(url) as resp:
                assert resp.status == 200
        assert seen == {"127.0.0.1": 3, "127.0.0.2": 3}
        # Re-resolved: only one address now.
        answers[0] = ["127.0.0.2"]
        await sidecar.resolver.refresh(config)
        seen.clear()
        for _ in range(4):
            async with client.get(url) as resp:
                assert resp.status == 200
        assert seen == {"127.0.0.2": 4}
        # A failed lookup keeps what the name had.
        answers[0] = []
        await sidecar.resolver.refresh(config)
        assert [(e.host, e.name) for e in eps.endpoints] == [("127.0.0.2", f"svc.test:{port}")]
    finally:
        await sidecar.stop()
        for r in runners:
            await r.cleanup()


async def test_the_first_slow_attempt_arms_hedging(upstream_factory, sidecar_factory, client):
    # A route whose attempts never ran long runs each attempt inline (no task to pay for); the
    # first one that runs past the per-try timeout is not hedged, and arms it for the next.
    up = await upstream_factory(hang(0.3), hang(5.0), reply(200, b"fast"))
    sc = await sidecar_factory(routes_yaml(up.url, FAST_AUTO))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200 and "x-retry-hedges" not in resp.headers
    async with client.get(sc.url + "/x") as resp:
        assert await resp.read() == b"fast" and resp.headers["x-retry-hedges"] == "1"


class HedgeBudgetThen(Budget):
    """The route's hedge budget, which also runs ``then`` when a hedge asks it (the moment a
    hedge is being decided, in the driver's turn)."""

    def __init__(self, policy: BudgetPolicy, then: Callable[[], object]) -> None:
        super().__init__(policy)
        self.then = then

    def try_retry(self, now: float) -> bool:
        self.then()
        return super().try_retry(now)


async def slow_503(request: web.Request) -> web.StreamResponse:
    await asyncio.sleep(0.3)
    return web.Response(status=503)


async def test_a_hedge_counts_only_if_it_leaves(upstream_factory, sidecar_factory, client):
    """Finding 5: the limit was asked whether there was room when a hedge was decided, and the
    hedge took its ticket a loop turn later in its own task; another request taking the last
    ticket in between (here: scheduled in the deciding turn) refused it after it had been
    counted. The answer said 2 attempts after 1 upstream call, and the retry the policy allows
    after the original's 503 was never made. The ticket is now taken when the hedge is decided:
    what is counted is what left."""
    up = await upstream_factory(slow_503, reply(200, b"second"))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            FAST_AUTO.replace("retry: {", "retry: {attempts: 2, ").replace(
                "bulkhead: {", "bulkhead: {max_concurrent: 2, min_concurrent: 2, "
            ),
        )
    )
    st = sc.sidecar.states.get("main")
    taken: list[Ticket] = []

    def another_request_takes_what_is_left() -> None:
        while (t := st.limiter.try_acquire(time.monotonic())) is not None:
            taken.append(t)
            assert len(taken) <= 2, "the concurrency limit never refused"

    loop = asyncio.get_running_loop()
    st.hedge_budget = HedgeBudgetThen(
        st.hedge_budget.policy, lambda: loop.call_soon(another_request_takes_what_is_left)
    )
    armed(sc)
    try:
        async with client.get(sc.url + "/x") as r:
            assert await r.read() == b"second"
            assert r.headers["x-retry-attempts"] == str(len(up.seen)) == "2"
    finally:
        for t in taken:
            st.limiter.release(time.monotonic(), t, None)
    assert [h.result for h in sc.recorder.hedges] == ["sent", "won"]
    await until(lambda: st.limiter.in_flight == 0 and attempt_tasks() == [])


async def test_a_hedge_cancelled_before_it_ran_gives_its_ticket_back() -> None:
    """The hedge's ticket is taken in the deciding turn and its task starts a turn later; a
    scope left in between (the client gone, a winner, the deadline) cancels the task before its
    first step, so the attempt's ``finally`` never runs: the ticket must come back all the
    same, and the attempt never reaches the wire."""
    route = parse_text(routes_yaml("http://127.0.0.1:9", FAST_AUTO), "<t>").routes[0]
    st = RouteState(route, None)
    clock = Clock()
    sent: list[int] = []

    async def send(
        number: int, timeout: float, endpoint: Endpoint, hedge: bool
    ) -> UpstreamResponse:
        sent.append(number)
        raise AssertionError("a cancelled hedge reached the wire")

    attempter = RouteAttempter(route, st, send, clock, Recorder(), hedgeable=True, adaptive=True)
    driver = Driver(
        route,
        attempter,
        Deadline.start(clock.monotonic(), 10.0),
        Constraints(),
        clock,
        random.Random(1),
        events=Recorder(),
        gate=SequenceGate("main", st, KillSwitch(), Lifecycle(), clock, random.Random(1)),
    )
    async with AttemptSet() as running:
        assert driver.maybe_hedge(running, report=True)
        assert st.limiter.in_flight == 1  # reserved in this turn
    # Left before the task ran: cancelled at its first step, its done-callback gave back.
    assert st.limiter.in_flight == 0 and sent == []
    assert (driver.number, driver.hedges) == (1, 1)


async def test_a_hedge_the_pool_refuses_counts_for_nothing(
    upstream_factory, sidecar_factory, client
):
    """A hedge that waited for a pooled connection in vain (``wait_timeout``) never left: it is
    no attempt and no hedge, so the retry the policy allows after the original's 503 is made."""

    async def slower_503(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.5)
        return web.Response(status=503)

    up = await upstream_factory(slower_503, reply(200, b"retried"))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            FAST_AUTO.replace("retry: {", "retry: {attempts: 2, "),
            top_extra="upstream_pool: {max_connections: 1, wait_timeout: 100ms}",
        )
    )
    armed(sc)
    async with client.get(sc.url + "/x") as r:
        assert await r.read() == b"retried"
        assert r.headers["x-retry-attempts"] == str(len(up.seen)) == "2"
        assert "x-retry-hedges" not in r.headers
    assert [a.outcome for a in sc.recorder.attempts][:1] == ["pool-exhausted"]


async def test_a_hedged_original_that_loses_is_measured(upstream_factory, sidecar_factory, client):
    """Finding 15: ``per_try_timeout: auto`` learnt only from the attempts that answered, so a
    hedged original that lost to its hedge was never measured: after a fast phase the estimate
    stayed low and kept hedging traffic a fresh sidecar would not hedge. The loser now counts
    as at least the time it ran (past the timeout); a hedge that loses to its original a moment
    after it started says nothing and is not counted."""
    up = await upstream_factory(hang(5.0), reply(200, b"fast"), hang(0.13), hang(5.0))
    sc = await sidecar_factory(routes_yaml(up.url, FAST_AUTO))
    st = sc.sidecar.states.get("main")
    armed(sc)
    async with client.get(sc.url + "/x") as r:
        assert await r.read() == b"fast" and r.headers["x-retry-hedges"] == "1"
    now = time.monotonic()
    assert st.latency.window.count(now) == 2  # the winner, and the original that lost
    assert (st.latency.window.percentile(now, 0.99) or 0.0) >= 0.1  # it ran >= 100 ms
    armed(sc)
    async with client.get(sc.url + "/x") as r:  # the original wins; its hedge is cancelled
        assert await r.read() == b"late" and r.headers["x-retry-hedges"] == "1"
    assert st.latency.window.count(time.monotonic()) == 3

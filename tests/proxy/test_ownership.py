"""Every path owns what it takes: each test ends a request early -- a cancelled waiter, a client
that leaves, a probe that never reached the upstream, a reader that stops reading, an exception
after an answer, a stalled body with tracing on, a pool hand-off under load, an upload aborted at
every point -- and checks that the slot, probe, connection and response it held were given back
and that the request was counted as it ended."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import random
import re
import socket
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sidecar.config.errors import ConfigError
from sidecar.config.model import BreakerPolicy, BulkheadPolicy, UpstreamPool
from sidecar.config.parse import parse_text
from sidecar.core import NoTimeLeft, Overloaded, Verdict
from sidecar.engine.bulkhead import Bulkhead
from sidecar.proxy.admission import is_trusted
from sidecar.retry.breaker import Admitted, Breaker, State
from sidecar.retry.budget import Budget
from sidecar.telemetry.tracing import Tracing
from sidecar.testing import FakeClock
from sidecar.upstream.connection import Connection
from sidecar.upstream.pool import Pool
from tests.conftest import Running, hang, reply, routes_yaml
from tests.faults import serve_ok
from tests.rawhttp import raw_server, read_head
from tests.wait import until

# -- the bulkhead: a waiter cancelled in the same loop turn as a release ------------------------


async def test_bulkhead_waiter_cancelled_in_the_turn_of_a_release_leaks_no_slot():
    bh = Bulkhead(BulkheadPolicy(max_concurrent=1, queue_timeout=5.0))
    holder_in = asyncio.Event()
    holder_out = asyncio.Event()
    waiters: list[asyncio.Task[None]] = []

    async def holder() -> None:
        async with bh.slot(1.0):
            holder_in.set()
            await holder_out.wait()
        # Same loop turn as the release (leaving the scope does not yield): the woken waiter
        # is cancelled before it can run -- the race that leaked every slot under stress.
        waiters[0].cancel()

    async def waiter() -> None:
        async with bh.slot(5.0):
            await asyncio.sleep(0)

    h = asyncio.create_task(holder())
    await holder_in.wait()
    waiters.append(asyncio.create_task(waiter()))
    await asyncio.sleep(0.01)  # the waiter is queued
    holder_out.set()
    await h
    with pytest.raises(asyncio.CancelledError):
        await waiters[0]
    assert bh.in_flight == 0
    async with asyncio.timeout(1):  # the slot is free again
        async with bh.slot(0.0):
            assert bh.in_flight == 1
    assert bh.in_flight == 0


async def test_bulkhead_many_waiters_cancelled_as_slots_free_leak_nothing():
    bh = Bulkhead(BulkheadPolicy(max_concurrent=3, queue_timeout=1.0))
    stop = asyncio.Event()
    waiters: list[asyncio.Task[str]] = []

    async def hold(i: int) -> None:
        async with bh.slot(1.0):
            await stop.wait()
        for w in waiters[i:15:3]:  # cancel the front of the queue in the turn of the release
            w.cancel()

    holders = [asyncio.create_task(hold(i)) for i in range(3)]
    await asyncio.sleep(0.01)

    async def wait_for_slot(t: float) -> str:
        try:
            async with bh.slot(t):
                await asyncio.sleep(0)
                return "got"
        except Overloaded:
            return "overloaded"

    waiters.extend(asyncio.create_task(wait_for_slot(0.5)) for _ in range(30))
    await asyncio.sleep(0.01)
    stop.set()
    await asyncio.gather(*holders)
    outcomes = await asyncio.gather(*waiters, return_exceptions=True)
    assert "got" in outcomes
    assert bh.in_flight == 0
    async with asyncio.timeout(1):
        async with bh.slot(0.0), bh.slot(0.0), bh.slot(0.0):
            assert bh.in_flight == 3


def bh_policy(n: int) -> BulkheadPolicy:
    return BulkheadPolicy(max_concurrent=n, queue_timeout=1.0)


async def admits(bh: Bulkhead, wait: float = 0.0) -> bool:
    """Whether one more sequence gets a slot now (it gives it straight back)."""
    try:
        async with bh.slot(wait):
            return True
    except Overloaded:
        return False


class Holders:
    """Tasks that each hold one bulkhead slot until told to let go."""

    def __init__(self, bh: Bulkhead) -> None:
        self.bh = bh
        self.tasks: list[asyncio.Task[None]] = []
        self.go: list[asyncio.Event] = []

    def add(self, wait: float = 5.0) -> asyncio.Task[None]:
        go = asyncio.Event()

        async def hold() -> None:
            async with self.bh.slot(wait):
                assert self.bh.in_flight <= self.bh.policy.max_concurrent  # never over
                await go.wait()

        task = asyncio.create_task(hold())
        self.tasks.append(task)
        self.go.append(go)
        return task

    async def let_go(self, i: int) -> None:
        self.go[i].set()
        await self.tasks[i]


async def test_bulkhead_reload_to_a_larger_size_admits_the_queue_first():
    bh = Bulkhead(bh_policy(1))
    held = Holders(bh)
    held.add()
    await asyncio.sleep(0)
    queued = [held.add(), held.add()]
    await asyncio.sleep(0.01)
    assert bh.in_flight == 1 and not any(t.done() for t in queued)
    bh.update_policy(bh_policy(3))  # two more permits: to the two queued, first come first
    await asyncio.sleep(0.01)
    assert bh.in_flight == 3
    assert not await admits(bh)  # 3 in flight is the new size: a newcomer waits
    for i in range(3):
        await held.let_go(i)
    assert bh.in_flight == 0
    async with bh.slot(0.0), bh.slot(0.0), bh.slot(0.0):
        assert not await admits(bh)


async def test_bulkhead_reload_to_a_smaller_size_applies_to_what_is_in_flight():
    """Four in flight, reloaded to one (an SRE shrinking the bulkhead in an incident): nothing
    new starts until fewer than one are in flight, as Envoy applies a lowered limit to the
    current count. Before, a reload started a new semaphore beside the old: a fifth sequence
    was let in at once."""
    bh = Bulkhead(bh_policy(4))
    held = Holders(bh)
    for _ in range(4):
        held.add()
    await asyncio.sleep(0)
    assert bh.in_flight == 4
    bh.update_policy(bh_policy(1))
    assert not await admits(bh, 0.05)
    for i in range(3):
        await held.let_go(i)
        assert bh.in_flight == 3 - i
        assert not await admits(bh)  # still at or over the new size
    await held.let_go(3)
    assert bh.in_flight == 0
    async with bh.slot(0.0):
        assert not await admits(bh)  # exactly one
    bh.update_policy(bh_policy(2))  # and back up: exactly two
    async with bh.slot(0.0), bh.slot(0.0):
        assert not await admits(bh)


async def test_bulkhead_waiter_cancelled_while_paying_a_shrink_debt_leaks_nothing():
    """A waiter that took a free permit to pay a shrink's debt and waits for the next one is
    cancelled there: the permit it paid stays paid, none is lost or made."""
    bh = Bulkhead(bh_policy(3))
    held = Holders(bh)
    held.add()
    held.add()
    await asyncio.sleep(0)
    bh.update_policy(bh_policy(1))  # 2 in flight, 1 free permit, a debt of 2
    waiter = held.add()
    await asyncio.sleep(0.01)  # it took the free permit, paid one, and waits for another
    assert not waiter.done() and bh.in_flight == 2
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    await held.let_go(0)
    await held.let_go(1)
    assert bh.in_flight == 0
    async with bh.slot(0.0):
        assert not await admits(bh)  # exactly the new size


@pytest.mark.parametrize("seed", range(12))
async def test_bulkhead_resized_at_random_never_exceeds_its_size_and_ends_exact(seed: int):
    """Sequences arrive, leave, time out and are cancelled while reloads resize the bulkhead
    at random: no sequence is ever let in over the size in force (``Holders`` checks on
    entry), and once all are gone exactly the last size can be taken."""
    rng = random.Random(seed)
    bh = Bulkhead(bh_policy(3))
    held = Holders(bh)
    for _ in range(300):
        op = rng.random()
        live = [i for i, t in enumerate(held.tasks) if not t.done()]
        if op < 0.35:
            held.add(rng.choice([0.0, 0.005, 5.0]))
        elif op < 0.6 and live:
            held.go[rng.choice(live)].set()
        elif op < 0.7 and live:
            held.tasks[rng.choice(live)].cancel()
        elif op < 0.8:
            bh.update_policy(bh_policy(rng.randint(1, 5)))
        await asyncio.sleep(rng.choice([0, 0, 0.001]))
    for go in held.go:
        go.set()
    ends = await asyncio.gather(*held.tasks, return_exceptions=True)
    assert [
        e for e in ends if not (e is None or isinstance(e, Overloaded | asyncio.CancelledError))
    ] == []
    assert bh.in_flight == 0
    size = bh.policy.max_concurrent
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(size):
            await stack.enter_async_context(bh.slot(0.0))
        assert bh.in_flight == size and not await admits(bh)


# -- the pool: a woken waiter that is cancelled hands the wake-up on -------------------------------


async def test_pool_woken_waiter_cancelled_hands_the_connection_on():
    server = await asyncio.start_server(serve_ok, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    loop = asyncio.get_running_loop()
    pool = Pool(
        loop,
        "127.0.0.1",
        port,
        UpstreamPool(max_connections=1, wait_timeout=5.0, connect_timeout=1.0, idle_timeout=4.0),
    )
    try:
        conn = await pool.acquire(1.0)
        first = asyncio.create_task(pool.acquire(5.0))
        second = asyncio.create_task(pool.acquire(5.0))
        await asyncio.sleep(0.01)
        # conn ended cleanly: release wakes `first`; cancel `first` in the same turn.
        conn.begin(False)
        conn.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await conn.wait_head(1.0)
        assert await conn.read_chunk(1.0) == b"ok"
        pool.release(conn)
        first.cancel()
        async with asyncio.timeout(2):  # `second` gets the connection, not its wait_timeout
            got = await second
        with pytest.raises(asyncio.CancelledError):
            await first
        pool.release(got)
        assert pool.stats().waiting == 0
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


async def test_pool_wait_is_bounded_by_the_attempt_time_left():
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # type: ignore[arg-type,return-value]
    port = server.sockets[0].getsockname()[1]
    pool = Pool(
        loop,
        "127.0.0.1",
        port,
        UpstreamPool(max_connections=1, wait_timeout=30.0, connect_timeout=1.0, idle_timeout=4.0),
    )
    try:
        conn = await pool.acquire(1.0)
        # The attempt's time, not the pool's wait, ended it: no time left, nothing sent (not
        # PoolExhausted, which says the pool stayed full for its whole wait_timeout).
        with pytest.raises(NoTimeLeft):
            async with asyncio.timeout(5):  # would be 30 s if the wait ignored the time left
                await pool.acquire(0.05)
        conn.abort()
        pool.release(conn)
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


# -- the breaker: neutral verdicts, probes that never reached the upstream -------------------------


def open_breaker(half_open_probes: int = 1) -> Breaker:
    """A breaker opened by two failures (open_for 1 s, no ramp)."""
    b = Breaker(
        BreakerPolicy(
            failure_ratio=0.5,
            min_sequences=2,
            window=10.0,
            open_for=1.0,
            half_open_probes=half_open_probes,
            ramp=0.0,
        )
    )
    b.record(0.0, Verdict.FAILURE, probe=False)
    b.record(0.1, Verdict.FAILURE, probe=False)
    assert b.state is State.OPEN
    return b


def test_a_neutral_probe_decides_nothing():
    b = open_breaker()
    adm = b.admit(2.0)
    assert isinstance(adm, Admitted) and adm.probe
    b.record(2.1, Verdict.NEUTRAL, probe=True, period=adm.period)
    assert b.state is State.HALF_OPEN  # not closed by a probe that never reached upstream
    adm2 = b.admit(2.2)
    assert isinstance(adm2, Admitted) and adm2.probe
    b.record(2.3, Verdict.FAILURE, probe=True, period=adm2.period)
    assert b.state is State.OPEN


def test_neutral_sequences_do_not_count_in_the_window():
    b = Breaker(BreakerPolicy(min_sequences=2, failure_ratio=0.5, window=10.0))
    for i in range(10):
        b.record(float(i) / 10, Verdict.NEUTRAL, probe=False)
    assert b.counts(1.0) == (0, 0)
    assert b.state is State.CLOSED


async def test_probe_answered_413_by_the_sidecar_does_not_close_the_breaker(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 1, max_body_bytes: 16}\n"
            "    breaker: {min_sequences: 2, failure_ratio: 0.5, open_for: 200ms,"
            " half_open_probes: 1, ramp: 0s}\n",
            top_extra="limits: {max_request_body: 64}",
        )
    )
    for _ in range(2):
        async with client.get(sc.url + "/x") as r:
            assert r.status == 503
    breaker = sc.sidecar.states.get("main").breaker
    assert breaker.state is State.OPEN
    await asyncio.sleep(0.3)

    async def too_big():  # chunked, so the 413 comes while streaming, after admission
        yield b"x" * 40
        yield b"y" * 40

    async with client.post(sc.url + "/x", data=too_big()) as r:
        assert r.status == 413
    assert breaker.state is State.HALF_OPEN  # the probe said nothing either way
    async with client.get(sc.url + "/x") as r:  # the next request is the probe
        assert r.status == 503
        assert r.headers["x-retry-fate"] != "breaker-open"
    assert breaker.state is State.OPEN


async def test_an_error_after_admission_does_not_wedge_the_breaker_half_open(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    up = await upstream_factory(reply(503), reply(503), reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 1}\n"
            "    breaker: {min_sequences: 2, failure_ratio: 0.5, open_for: 100ms,"
            " half_open_probes: 1, ramp: 0s}\n",
        )
    )
    for _ in range(2):
        async with client.get(sc.url + "/x") as r:
            assert r.status == 503
    state = sc.sidecar.states.get("main")
    assert state.breaker.state is State.OPEN
    await asyncio.sleep(0.2)

    class Exploding(Budget):
        def record_request(self, now: float) -> None:
            raise RuntimeError("a bug between admission and the guarded block")

    monkeypatch.setattr(state, "budget", Exploding(state.budget.policy))
    async with client.get(sc.url + "/x") as r:
        assert r.status == 502  # the handler's internal-error answer
    monkeypatch.undo()
    async with client.get(sc.url + "/x") as r:  # the failed probe decided nothing
        assert r.status == 200
    assert state.breaker.state is State.CLOSED
    assert state.bulkhead.in_flight == 0


async def test_aborted_uploads_are_not_upstream_resets(upstream_factory, sidecar_factory):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {max_body_bytes: 16}\n"
            "    breaker: {min_sequences: 3, failure_ratio: 0.5}\n",
        )
    )
    state = sc.sidecar.states.get("main")

    def ended(n: int) -> Callable[[], bool]:
        return lambda: len(sc.recorder.sequences) == n and state.bulkhead.in_flight == 0

    for i in range(5):
        _r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"a" * 5000)
        await w.drain()
        # The sequence is admitted and streaming the upload upstream...
        await until(lambda: state.bulkhead.in_flight == 1, "the upload to be in flight")
        w.transport.abort()  # ...when the client leaves half-way through it
        await until(ended(i + 1), "the aborted request to end")
    assert state.breaker.state is State.CLOSED
    assert state.breaker.counts(sc.sidecar.clock.monotonic()) == (0, 0)
    assert state.bulkhead.in_flight == 0
    resets = [e for e in sc.recorder.attempts if e.outcome == "reset"]
    assert resets == []
    gone = [e for e in sc.recorder.sequences if e.fate == "client-gone"]
    assert len(gone) == 5


# -- the client leaving cancels the work ----------------------------------------------------------


@pytest.mark.slow
async def test_a_client_that_leaves_stops_its_retries(upstream_factory, sidecar_factory):
    up = await upstream_factory(reply(503, headers={"Retry-After": "1"}))
    sc = await sidecar_factory(routes_yaml(up.url, "    retry: {attempts: 5}\n"))
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as s:
        leaving = asyncio.create_task(s.get(sc.url + "/x"))
        await until(lambda: len(up.seen) == 1, "the first attempt to reach the upstream")
        first_seen = loop.time()
        leaving.cancel()  # the client leaves during the attempt or the 1 s Retry-After wait
        with pytest.raises(asyncio.CancelledError):
            await leaving
    await until(lambda: sc.recorder.sequences, "the sequence to end")
    assert [e.fate for e in sc.recorder.sequences] == ["client-gone"]
    # Not an event to wait for but one that must not come: attempt 2 would have been sent
    # 1 s after attempt 1; wait that out with margin before checking it never was.
    await asyncio.sleep(max(0.0, first_seen + 1.5 - loop.time()))
    assert len(up.seen) == 1
    state = sc.sidecar.states.get("main")
    assert state.bulkhead.in_flight == 0
    assert state.breaker.counts(sc.sidecar.clock.monotonic()) == (0, 0)  # neutral
    text = sc.sidecar.metrics.render()
    assert 'retry_sidecar_requests_total{route="main",fate="client-gone"} 1' in text


async def test_a_client_that_leaves_mid_attempt_frees_the_upstream_connection(
    upstream_factory, sidecar_factory
):
    # The upstream and the route's timeouts outlast the wait below by far: a connection kept
    # busy after the client left cannot be freed by a timeout before the test gives up.
    up = await upstream_factory(hang(120.0))
    sc = await sidecar_factory(
        routes_yaml(up.url, "    timeout: 120s\n    retry: {per_try_timeout: 120s}\n")
    )
    async with aiohttp.ClientSession() as s:
        leaving = asyncio.create_task(s.get(sc.url + "/x"))
        await until(lambda: len(up.seen) == 1, "the attempt to reach the upstream")
        assert [p.total for p in sc.sidecar.client.stats().values()] == [1]
        leaving.cancel()  # the client leaves mid-attempt
        with pytest.raises(asyncio.CancelledError):
            await leaving
    await until(
        lambda: all(p.total == 0 for p in sc.sidecar.client.stats().values()),
        "the upstream connection to be aborted, not kept busy",
    )
    assert sc.sidecar.states.get("main").bulkhead.in_flight == 0


# -- the deadline bounds every wait ---------------------------------------------------------------


@pytest.mark.parametrize("stopped_clock", [False, True], ids=["clock", "timer-before-the-clock"])
async def test_the_bulkhead_wait_is_charged_to_the_deadline(
    upstream_factory, sidecar_factory, stopped_clock: bool
):
    """With a stopped clock the loop's timer ends the wait while the clock has not reached the
    deadline, as uvloop's timers sometimes do by a fraction of a millisecond: the wait that the
    deadline bounded is still a deadline, not ``overloaded`` (it was judged by reading the clock
    again)."""
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text="late")

    up = await upstream_factory(held)
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    timeout: 30s\n"
            "    retry: {attempts: 1, per_try_timeout: 30s}\n"
            "    bulkhead: {max_concurrent: 1, queue_timeout: 30s}\n",
        ),
        **({"clock": FakeClock()} if stopped_clock else {}),
    )
    async with aiohttp.ClientSession() as s:

        async def get(headers: dict[str, str]) -> tuple[int, str]:
            async with s.get(sc.url + "/x", headers=headers) as r:
                return r.status, r.headers["x-retry-fate"]

        first = asyncio.create_task(get({}))  # holds the only slot until released
        await until(lambda: len(up.seen) == 1, "the first request to reach the upstream")
        # 200 ms of deadline left, a 30 s queue timeout: the deadline ends the wait.
        second = await get({"x-request-timeout-ms": "200"})
        assert second == (504, "deadline")
        release.set()
        assert (await first) == (200, "success")
    assert len(up.seen) == 1  # the second request never reached the upstream
    state = sc.sidecar.states.get("main")
    assert state.bulkhead.in_flight == 0
    # the waiter that never reached the upstream says nothing to the breaker
    assert state.breaker.counts(sc.sidecar.clock.monotonic()) == (1, 0)


# -- the send timeout: a client that stops reading ------------------------------------------------


async def test_a_client_that_stops_reading_is_cut_and_gives_everything_back(
    upstream_factory, sidecar_factory
):
    big = b"z" * (8 * 1024 * 1024)

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Length": str(len(big))})
        await resp.prepare(request)
        for i in range(0, len(big), 65536):
            await resp.write(big[i : i + 65536])
        return resp

    up = await upstream_factory(stream)
    sc = await sidecar_factory(routes_yaml(up.url, top_extra="limits: {send_timeout: 300ms}"))
    sock = socket.create_connection(("127.0.0.1", sc.sidecar.proxy_port))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
    try:
        state = sc.sidecar.states.get("main")
        await until(  # the relay starts, fills the socket, then is cut
            lambda: state.bulkhead.in_flight == 0 and len(up.seen) == 1,
            "the relay to a client that stopped reading to be cut",
        )
        stats = sc.sidecar.client.stats()
        assert all(p.total == p.idle for p in stats.values()), stats
        assert 'reason="send-timeout"} 1' in sc.sidecar.metrics.render()
    finally:
        sock.close()


# -- smaller defects ------------------------------------------------------------------------------


async def test_an_empty_idempotency_key_is_no_key(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.post(sc.url + "/x", data=b"{}", headers={"Idempotency-Key": ""}) as r:
        assert r.status == 503
        assert r.headers["x-retry-fate"] == "non-idempotent"
    assert len(up.seen) == 1


def test_ipv4_mapped_peers_match_ipv4_trusted_peers():
    import ipaddress

    nets = (ipaddress.ip_network("127.0.0.0/8"),)
    assert is_trusted("::ffff:127.0.0.1", nets)
    assert not is_trusted("::ffff:10.0.0.1", nets)


@pytest.mark.parametrize("code", [200, 204, 301, 101])
def test_retry_on_refuses_statuses_that_are_not_errors(code: int):
    text = routes_yaml("http://127.0.0.1:1", f"    retry: {{retry_on: [reset, {code}]}}\n")
    with pytest.raises(ConfigError) as e:
        parse_text(text, "p.yaml")
    assert "routes[0].retry.retry_on" in str(e.value)


async def test_timed_out_request_heads_log_no_traceback(sidecar_factory, caplog):
    sc = await sidecar_factory(
        routes_yaml("http://127.0.0.1:9", top_extra="limits: {header_timeout: 200ms}")
    )
    caplog.set_level(logging.DEBUG)
    conns = []
    for _ in range(20):
        r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(b"GET / HTTP/1.1\r\nHost: x\r\n")
        conns.append((r, w))
    for r, _w in conns:
        head = await asyncio.wait_for(r.read(), 5)
        assert head.startswith(b"HTTP/1.1 408")
    assert not [rec for rec in caplog.records if rec.exc_info or rec.levelno >= logging.ERROR]


async def test_an_upstream_dying_mid_body_is_a_failed_sequence(sidecar_factory):
    from tests.faults import reset_mid_body

    server = await asyncio.start_server(reset_mid_body, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        async with aiohttp.ClientSession() as s:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with s.get(sc.url + "/x") as r:
                    assert r.status == 200
                    await r.read()
        await asyncio.sleep(0.1)
        state = sc.sidecar.states.get("main")
        assert state.breaker.counts(sc.sidecar.clock.monotonic()) == (1, 1)
        assert state.bulkhead.in_flight == 0
        assert all(p.total == 0 for p in sc.sidecar.client.stats().values())
    finally:
        server.close()
        await server.wait_closed()


def _memory_tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# -- size limits: a chunked upload between max_request_body and max_body_bytes --------------------


async def test_a_chunked_body_over_max_request_body_is_refused_even_under_max_body_bytes(
    upstream_factory, sidecar_factory, client
):
    """``limits.max_request_body`` is checked against Content-Length up front and, for streamed
    bodies, in ``BodyStream``; a chunked body that fits ``retry.max_body_bytes`` is read by
    ``_read_prefix`` (up to max_body_bytes + 1 bytes held in memory) and sent upstream whole,
    with no check at all. With max_body_bytes 4 KiB and max_request_body 64 bytes a 500-byte
    chunked upload reaches the upstream instead of getting 413."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {max_body_bytes: 4096}\n",
            top_extra="limits: {max_request_body: 64}",
        )
    )

    async def chunked() -> AsyncIterator[bytes]:
        yield b"x" * 250
        yield b"y" * 250

    async with client.post(sc.url + "/x", data=chunked()) as r:
        assert r.status == 413
    assert up.seen == []


# -- the engine: an exception after the upstream answered -----------------------------------------


async def test_an_exception_after_an_upstream_answer_gives_its_connection_back(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    """``Sequence`` discards ``self.result.response`` on exit, but ``self.result`` is set only
    when the sequence driver returns. Between ``send()`` handing back a response and that return,
    the response is a local of the sequence driver (outcome, events, decide, kill switch, budget,
    drain are all asked there): any exception on that stretch -- here the budget raising, as the
    existing test of an error after admission does -- leaves the UpstreamResponse undiscarded,
    so its connection is never released: the pool counts it busy for ever (``total`` 1,
    ``idle`` 0) and ``max_connections`` shrinks by one per occurrence."""
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(routes_yaml(up.url, "    retry: {attempts: 2}\n"))
    state = sc.sidecar.states.get("main")

    class Exploding(Budget):
        def try_retry(self, now: float) -> bool:
            raise RuntimeError("a bug between the answer and the sequence result")

    monkeypatch.setattr(state, "budget", Exploding(state.budget.policy))
    async with client.get(sc.url + "/x") as r:
        assert r.status == 502  # the handler's internal-error answer
    monkeypatch.undo()
    assert state.bulkhead.in_flight == 0
    for _ in range(50):  # a bounded wait for the release, never a time threshold
        if all(p.total == p.idle for p in sc.sidecar.client.stats().values()):
            break
        await asyncio.sleep(0.02)
    stats = sc.sidecar.client.stats()
    assert all(p.total == p.idle for p in stats.values()), stats


# -- tracing and accounting: a request body that stalls -------------------------------------------


async def test_a_stalled_request_body_ends_its_server_span_and_is_counted(
    upstream_factory, sidecar_factory
):
    """A body that stalls raises ``BodyStalled``, caught only in ``ProxyHandler.__call__``
    (408). The server span opened in ``_handle`` is ended only by ``_finish`` and ``_gone``,
    neither of which runs on that path (nor on the internal-error 502 path): the span is never
    ended or exported -- the trace of exactly the failing request is lost -- and no
    SequenceEnded is emitted, so ``retry_sidecar_requests_total`` never counts a request whose
    streamed body was partly sent upstream. Both a stall in the buffered prefix and one
    mid-stream (after the attempt began) are shown."""
    up = await upstream_factory(reply(200))
    tracing, exporter = _memory_tracing()
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {max_body_bytes: 16}\n",
            top_extra="limits: {body_idle_timeout: 200ms}",
        ),
        tracing=tracing,
    )
    for sent in (8, 5000):  # stalls inside the buffered prefix, then mid-stream
        r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"a" * sent)
        await w.drain()
        out = await asyncio.wait_for(r.read(4096), 5)
        assert out.startswith(b"HTTP/1.1 408")
        w.close()
    servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert len(servers) == 2
    assert all(s.attributes and s.attributes["http.response.status_code"] == 408 for s in servers)
    assert [e.status for e in sc.recorder.sequences] == [408, 408]


# -- breaker accounting ---------------------------------------------------------------------------


async def test_a_retry_refused_for_lack_of_a_connection_keeps_the_upstream_failure(
    upstream_factory, sidecar_factory, client
):
    """Attempt 1 gets a 503 from the upstream; during the backoff the pool fills (two requests
    of another route to the same upstream hang), so attempt 2 ends in PoolExhausted.
    the sequence driver returns ``SequenceResult(OVERLOADED, error=PoolExhausted)`` without the
    503, and ``verdict`` turns a LocalOverload into NEUTRAL: the breaker never hears of the
    failure. In an incident (a hanging upstream holds every pooled connection) most retries
    end this way, so the failures that did reach the upstream are exactly the ones dropped and
    the breaker stays closed. (``NoTimeLeft`` at the top of the loop after a failed attempt
    drops it the same way.)"""
    first_answered = asyncio.Event()
    release_hangs = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/hang"):
            await release_hangs.wait()
            return web.Response(text="late")
        first_answered.set()
        return web.Response(status=503)

    up = await upstream_factory(upstream)
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    match: {path_prefix: /x}\n"
            "    retry: {attempts: 2, per_try_timeout: 5s,"
            " backoff: {strategy: constant, base: 1s, max: 1s}}\n"
            f'  - name: other\n    upstream: "{up.url}"\n'
            "    retry: {attempts: 1, per_try_timeout: 10s}\n",
            top_extra="upstream_pool: {max_connections: 2, wait_timeout: 50ms}",
        )
    )

    async def get(path: str) -> tuple[int, str | None]:
        async with client.get(sc.url + path) as r:
            await r.read()
            return r.status, r.headers.get("x-retry-fate")

    a = asyncio.create_task(get("/x"))
    await first_answered.wait()
    hangs = [asyncio.create_task(get("/hang")) for _ in range(2)]
    while len(up.seen) < 3:  # both hanging requests hold a connection before the retry
        await asyncio.sleep(0.01)
    assert await a == (503, "overloaded")
    release_hangs.set()
    await asyncio.gather(*hangs)
    outcomes = [(e.route, e.attempt, e.outcome) for e in sc.recorder.attempts if e.route == "main"]
    assert outcomes == [("main", 1, "503"), ("main", 2, "pool-exhausted")]
    breaker = sc.sidecar.states.get("main").breaker
    assert breaker.counts(sc.sidecar.clock.monotonic()) == (1, 1)


async def test_a_client_leaving_while_a_final_503_is_relayed_still_counts_the_failure(
    upstream_factory, sidecar_factory
):
    """The sequence has ended -- the upstream answered 503, no retry left -- and the 503's body
    (larger than the one-write size, so it is streamed inside the scope) is being relayed when
    the client goes away. The cancellation reaches ``Sequence.__aexit__`` as an exception,
    which records NEUTRAL whatever the result says: the upstream's failure is erased because
    the client left after it was known. Clients time out fastest in an incident, so this
    hides failures exactly then; a relay that breaks on the upstream's side is already kept as
    FAILURE (``body_failed``), the client's side should not erase the verdict either."""
    up = await upstream_factory(reply(503, b"e" * (4 * 1024 * 1024)))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 1}\n    breaker: {min_sequences: 2, failure_ratio: 0.5}\n",
        )
    )
    state = sc.sidecar.states.get("main")
    for _ in range(2):
        r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503")
        w.transport.abort()  # gone mid-body
        for _ in range(50):
            if state.bulkhead.in_flight == 0:
                break
            await asyncio.sleep(0.02)
    assert state.bulkhead.in_flight == 0
    assert state.breaker.state is State.OPEN


def test_a_probe_from_an_earlier_half_open_period_has_no_say_in_this_one():
    """A probe admitted in one half-open period may still be in flight when the breaker has
    reopened and turned half-open again: its late verdict must not count toward deciding the
    new period (``Admitted`` carries its period, ``record`` ignores other periods)."""
    b = open_breaker(half_open_probes=2)
    p1, p2 = b.admit(1.2), b.admit(1.2)
    assert isinstance(p1, Admitted) and p1.probe and isinstance(p2, Admitted) and p2.probe
    b.record(1.3, Verdict.FAILURE, probe=True, period=p2.period)  # P2 fails: open again
    assert b.state is State.OPEN and b.open_period == 2.0
    p3 = b.admit(3.4)  # a new half-open period
    assert isinstance(p3, Admitted) and p3.probe and p3.period != p1.period
    b.record(3.5, Verdict.SUCCESS, probe=True, period=p1.period)  # P1, of the previous one
    b.record(3.5, Verdict.SUCCESS, probe=True, period=p3.period)
    assert b.state is State.HALF_OPEN  # one judged of the two this period needs
    p4 = b.admit(3.6)
    assert isinstance(p4, Admitted)
    b.record(3.7, Verdict.SUCCESS, probe=True, period=p4.period)
    assert b.state is State.CLOSED


# -- the head timeout: armed by body bytes of a request already answered --------------------------


async def test_body_bytes_after_an_early_answer_do_not_arm_the_head_timeout(
    upstream_factory, sidecar_factory
):
    """The sidecar answers before reading the body (413 for a declared length over the limit;
    likewise breaker-open or overloaded with a streamed body), keeps the connection alive, and
    aiohttp discards the body as it comes. ``GuardedRequestHandler.data_received`` arms the
    head timer on ANY data while no request is in progress (``request_done`` already ran), and
    those body bytes parse into no message, so nothing cancels it: ``header_timeout`` later an
    unsolicited 408 is written on the idle keep-alive connection and it is closed (75 s
    keep-alive promised), and the client's next request -- complete on arrival -- reads that
    408 as its answer."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url, top_extra="limits: {max_request_body: 64, header_timeout: 300ms}")
    )
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
    await w.drain()
    head = await r.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"Connection: close" not in head
    m = re.search(rb"Content-Length: (\d+)", head)
    assert m is not None
    await r.readexactly(int(m.group(1)))
    w.write(b"a" * 100)  # the declared body follows; aiohttp reads and discards it
    await w.drain()
    await asyncio.sleep(0.8)  # idle, well within the keep-alive timeout
    w.write(b"GET /next HTTP/1.1\r\nHost: x\r\n\r\n")
    await w.drain()
    nxt = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    w.close()
    assert nxt.startswith(b"HTTP/1.1 200"), nxt


# -- the pool: the hand-off to a woken waiter -----------------------------------------------------


async def use_ok(c: Connection) -> None:
    """One whole exchange on a pooled connection, which ends clean and reusable."""
    c.begin(False)
    c.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    c.request_sent()
    await c.wait_head(1.0)
    assert await c.read_chunk(1.0) == b"ok"
    assert await c.read_chunk(1.0) == b""
    assert c.reusable()


@contextlib.asynccontextmanager
async def one_connection_pool(wait_timeout: float) -> AsyncIterator[Pool]:
    """A pool of one connection to a ``serve_ok`` upstream; closed, with the upstream, after."""
    server = await asyncio.start_server(serve_ok, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    limits = UpstreamPool(
        max_connections=1, wait_timeout=wait_timeout, connect_timeout=1.0, idle_timeout=4.0
    )
    pool = Pool(asyncio.get_running_loop(), "127.0.0.1", port, limits)
    try:
        yield pool
    finally:
        pool.close()
        server.close()
        await server.wait_closed()


async def test_a_woken_pool_waiter_is_not_overtaken_by_newcomers():
    """``Pool.release`` puts the connection in ``_idle`` and wakes the head waiter, but
    ``acquire`` takes an idle connection without looking at the queue: a caller that runs
    before the woken waiter (any handler ready in the same loop turn -- under load the ready
    queue is long) takes it, and the waiter, finding nothing, re-queues at the BACK with the
    rest of its time. Here the connection is freed eight times while one waiter waits, each time
    for it, and it still ends in PoolExhausted (503 ``pool-exhausted``) after the newcomers were
    served. asyncio.Semaphore refuses newcomers while waiters queue; the pool should hand the
    released connection to the woken waiter itself (or refuse barging while ``_waiters``)."""

    async with one_connection_pool(wait_timeout=0.5) as pool:
        conn = await pool.acquire(1.0)
        try:
            await use_ok(conn)
            waiter = asyncio.create_task(pool.acquire(5.0))
            await until(lambda: pool.stats().waiting == 1, "the waiter to queue")
            newcomer = asyncio.create_task(pool.acquire(5.0))  # ready in the release's turn
            pool.release(conn)
            got = await waiter  # the released connection went to the head of the queue
            assert not newcomer.done()  # the newcomer queues behind it
            await use_ok(got)
            pool.release(got)
            conn = await newcomer  # and is served next
            await use_ok(conn)
        finally:
            pool.release(conn)


def _stray_bytes(c: Connection) -> None:
    c.data_received(b"HTTP/1.1 200 OK\r\n\r\n")  # bytes nobody asked for


def _peer_closed(c: Connection) -> None:
    assert c.transport is not None
    if not c.eof_received():  # what the loop does on the upstream's FIN
        c.transport.close()


@pytest.mark.parametrize("goes_bad", [_stray_bytes, _peer_closed], ids=["stray-bytes", "peer-fin"])
async def test_a_connection_that_goes_bad_before_its_waiter_runs_is_replaced(
    goes_bad: Callable[[Connection], None],
):
    """``release`` hands a clean connection to the head waiter, which runs a loop turn later.
    In between, the loop may deliver the upstream's I/O first (uvloop polls before it runs the
    ready queue): stray bytes make the connection must-close, a FIN closes its transport.
    Without a second look the waiter got it anyway: ``begin`` raised ``IllegalConnTransition`` (an
    internal error for the client) or the request went into a closing transport. The waiter
    now drops it and connects in its slot, as ``acquire`` does with a stale idle connection."""
    async with one_connection_pool(wait_timeout=5.0) as pool:
        conn = await pool.acquire(1.0)
        try:
            await use_ok(conn)
            waiter = asyncio.create_task(pool.acquire(5.0))
            await until(lambda: pool.stats().waiting == 1, "the waiter to queue")
            pool.release(conn)  # handed to the waiter, which has not run yet
            goes_bad(conn)  # the loop delivers the upstream's I/O before the waiter's turn
            got = await waiter
            assert got is not conn and not conn.usable()
            await use_ok(got)  # a fresh connection, in the same slot
            assert pool.stats().total == 1
            conn = got
        finally:
            pool.release(conn)


# -- a retried upload aborted at every point, bodiless answers, drains, client exits --------


@pytest.mark.slow
async def test_aborts_at_every_point_of_a_retried_upload_leave_nothing_behind(
    upstream_factory, sidecar_factory
):
    """Buffered and streamed uploads to an upstream that answers 503 + Retry-After: 0 and then
    a slowly streamed 200, with tracing on; the client leaves at 25 points spread over the
    upload, the attempts, the Retry-After wait and the relay. Afterwards the bulkhead is empty,
    every pooled connection is idle, tasks and descriptors are back to their baseline, and each
    request was counted exactly once (one SequenceEnded and one ended server span each)."""
    calls = [0]

    async def flaky(request: web.Request) -> web.StreamResponse:
        calls[0] += 1
        await asyncio.sleep(0.03)
        if calls[0] % 2:
            return web.Response(status=503, headers={"Retry-After": "0"})
        resp = web.StreamResponse(headers={"Content-Length": str(200_000)})
        await resp.prepare(request)
        for _ in range(20):
            await resp.write(b"r" * 10_000)
            await asyncio.sleep(0.005)
        return resp

    up = await upstream_factory(flaky)
    tracing, exporter = _memory_tracing()
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 3, max_body_bytes: 1000, non_idempotent: always}\n"
            "    breaker: {min_sequences: 100000}\n",
        ),
        tracing=tracing,
    )
    gc.collect()
    base_tasks, base_fds = len(asyncio.all_tasks()), _fds()
    requests = 0
    for i in range(25):
        d = i * 0.007
        for size in (500, 5000):  # buffered, then streamed (over max_body_bytes)
            requests += 1
            _r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
            w.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            w.write(b"p" * (size // 2))
            await asyncio.sleep(d / 2)
            w.write(b"p" * (size - size // 2))
            await asyncio.sleep(d)
            w.transport.abort()
    state = sc.sidecar.states.get("main")
    for _ in range(100):  # handlers finish; bounded, never a time threshold
        await asyncio.sleep(0.05)
        if len(sc.recorder.sequences) == requests and state.bulkhead.in_flight == 0:
            break
    assert state.bulkhead.in_flight == 0
    stats = sc.sidecar.client.stats()
    assert all(p.total == p.idle and p.waiting == 0 for p in stats.values()), stats
    fates = Counter(e.fate for e in sc.recorder.sequences)
    assert sum(fates.values()) == requests, fates
    assert fates["client-gone"] > 0
    servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert len(servers) == requests
    sc.sidecar.client.close()  # idle pooled connections (and their upstream handlers) go
    for _ in range(100):
        await asyncio.sleep(0.05)
        gc.collect()
        if len(asyncio.all_tasks()) <= base_tasks and _fds() <= base_fds:
            break
    assert len(asyncio.all_tasks()) <= base_tasks
    assert _fds() <= base_fds


async def test_drain_during_a_retry_after_wait_makes_one_final_attempt_and_keeps_nothing(
    upstream_factory, sidecar_factory, client
):
    """SIGTERM's drain (``Sidecar.stop``) while a sequence sleeps a 5 s Retry-After: the sleep is
    cut, one final attempt answers the client, and the slot and connection are given back."""
    up = await upstream_factory(reply(503, headers={"Retry-After": "5"}), reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url, "    retry: {attempts: 3, retry_after: {honor: true, max: 10s}}\n")
    )
    pending = asyncio.create_task(client.get(sc.url + "/x"))
    await until(lambda: sc.sidecar.life.sleeping == 1, "the Retry-After wait")
    stopping = asyncio.create_task(sc.sidecar.stop())
    r = await pending
    assert (r.status, r.headers["x-retry-fate"]) == (200, "success")
    r.release()
    await stopping
    assert len(up.seen) == 2
    assert sc.sidecar.states.get("main").bulkhead.in_flight == 0
    assert all(p.total == 0 for p in sc.sidecar.client.stats().values())


async def test_a_client_half_closing_mid_upload_is_client_gone_not_an_upstream_failure(
    upstream_factory, sidecar_factory
):
    """A client that shuts its sending side (FIN, not RST) before its declared body is complete,
    in the buffered prefix and mid-stream: counted client-gone, nothing recorded against the
    upstream, nothing kept."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url, "    retry: {max_body_bytes: 16}\n"))
    for sent in (8, 5000):
        r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"a" * sent)
        await w.drain()
        await asyncio.sleep(0.1)
        w.write_eof()
        await asyncio.wait_for(r.read(), 5)
        w.close()
    state = sc.sidecar.states.get("main")
    for _ in range(50):
        if len(sc.recorder.sequences) == 2:
            break
        await asyncio.sleep(0.02)
    assert [e.fate for e in sc.recorder.sequences] == ["client-gone", "client-gone"]
    assert state.breaker.counts(sc.sidecar.clock.monotonic()) == (0, 0)
    assert [e for e in sc.recorder.attempts if e.outcome == "reset"] == []
    assert state.bulkhead.in_flight == 0
    assert all(p.total == p.idle for p in sc.sidecar.client.stats().values())


async def test_a_client_leaving_after_100_continue_gives_everything_back(
    upstream_factory, sidecar_factory
):
    """``Expect: 100-continue``: the sidecar sends 100 Continue, the client sends part of a
    streamed body and leaves. Counted client-gone, the slot and the connection come back."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url, "    retry: {max_body_bytes: 16}\n"))
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(
        b"POST /up HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\nExpect: 100-continue\r\n\r\n"
    )
    await w.drain()
    assert (await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)).startswith(b"HTTP/1.1 100")
    w.write(b"a" * 5000)
    await w.drain()
    await asyncio.sleep(0.1)
    w.transport.abort()
    state = sc.sidecar.states.get("main")
    for _ in range(50):
        if sc.recorder.sequences:
            break
        await asyncio.sleep(0.02)
    assert [e.fate for e in sc.recorder.sequences] == ["client-gone"]
    assert state.bulkhead.in_flight == 0
    assert all(p.total == p.idle for p in sc.sidecar.client.stats().values())


async def test_a_kill_switch_set_during_the_backoff_stops_the_scheduled_retry(
    upstream_factory, sidecar_factory, client
):
    """The kill switch is asked only when an attempt's outcome is judged, never after the
    backoff or Retry-After wait: a retry scheduled before the switch flips is still sent when
    its wait ends. In an incident every sequence already waiting (Retry-After up to
    ``retry_after.max``) fires its retry after the SRE turned retries off. The attempt loop
    should ask the switch again right before each retry (deadline -> kill switch -> ... ->
    attempt) and end there with fate kill-switch (the last upstream answer, 503, or the
    sidecar's own error for it -- the test accepts either)."""
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 3, backoff: {strategy: constant, base: 300ms, max: 300ms}}\n",
        )
    )
    pending = asyncio.create_task(client.get(sc.url + "/x"))
    while not up.seen:
        await asyncio.sleep(0.01)
    clock = sc.sidecar.clock
    sc.sidecar.kill.set("route:main", 60.0, "review", "test", clock.monotonic(), clock.wall())
    r = await pending
    r.release()
    state = sc.sidecar.states.get("main")
    assert state.bulkhead.in_flight == 0
    assert len(up.seen) == 1  # no retry after the switch
    assert r.headers["x-retry-fate"] == "kill-switch"
    assert r.status >= 500


# -- a client whose close is seen by a write before aiohttp cancels the handler ------------------
#
# uvloop marks the transport closing at once and calls ``connection_lost`` -- which cancels the
# handler -- a loop turn later, so a write can see the client gone first; each write the handler
# makes is tried. The close is put just before a write by a patch on an interpreted class
# (aiohttp's ``StreamWriter``, which every write of the HTTP/1.1 sink goes through): the race
# itself cannot be timed from a test. The other early exits (a hedge's losers unwinding, the deadline ending a wait for
# a pooled connection, a DLQ record stored after its client left) follow.


def _close_before_writing(monkeypatch: pytest.MonkeyPatch, starting: bytes) -> None:
    """The client's close arrives just before the handler writes bytes starting with
    ``starting`` through aiohttp's writer (a 100 Continue, a relayed 1xx): every write of the
    HTTP/1.1 sink (``proxy/h1.py``) goes through ``StreamWriter._write`` or ``_writelines``
    (as aiohttp's own responses do)."""
    real_write, real_lines = StreamWriter._write, StreamWriter._writelines

    def close_first(writer: StreamWriter, data: bytes) -> None:
        transport = writer._protocol.transport
        if data.startswith(starting) and transport is not None:
            transport.close()

    def write(self: StreamWriter, chunk: Any) -> None:
        close_first(self, bytes(chunk))
        real_write(self, chunk)

    def writelines(self: StreamWriter, chunks: Any) -> None:
        chunks = list(chunks)
        close_first(self, b"".join(bytes(c) for c in chunks))
        real_lines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", write)
    monkeypatch.setattr(StreamWriter, "_writelines", writelines)


async def _ended(sc: Running, n: int = 1) -> None:
    """Until ``n`` sequences were counted (bounded; not a time threshold)."""
    for _ in range(100):
        if len(sc.recorder.sequences) >= n:
            return
        await asyncio.sleep(0.02)


def _nothing_kept(sc: Running) -> None:
    assert sc.sidecar.states.get("main").bulkhead.in_flight == 0
    stats = sc.sidecar.client.stats()
    assert all(p.total == p.idle for p in stats.values()), stats


async def _get_as_a_client_that_left(sc: Running, caplog: pytest.LogCaptureFixture) -> bytes:
    """GET /x, with the client's close put before a write by the test's patch: what the client
    read before its connection ended. Checks the request counted client-gone (499), no internal
    error, the upstream's success kept for the breaker, nothing held."""
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    got = await asyncio.wait_for(r.read(), 5)  # the connection ends
    w.close()
    await _ended(sc)
    assert [(e.fate, e.status) for e in sc.recorder.sequences] == [("client-gone", 499)]
    assert "internal error" not in caplog.text
    state = sc.sidecar.states.get("main")
    assert state.breaker.counts(sc.sidecar.clock.monotonic()) == (1, 0)  # one success
    _nothing_kept(sc)
    return got


async def test_a_client_gone_before_a_relayed_1xx_is_written_is_client_gone(
    sidecar_factory, caplog, monkeypatch
):
    """The upstream sent 103 Early Hints and its final 200; the client's close arrived just
    before the 103 was relayed. The write raised ConnectionResetError outside the relay's
    handling: logged as an internal error and counted under fate ``exhausted`` with a 502. It
    is a client that left (499, ``client-gone``); the upstream's success stands."""

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_head(r)
            w.write(
                b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
            )
            await w.drain()

    _close_before_writing(monkeypatch, b"HTTP/1.1 103")
    async with raw_server(upstream) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        assert await _get_as_a_client_that_left(sc, caplog) == b""  # nothing written


async def test_a_client_gone_before_100_continue_is_counted_and_its_span_ended(
    upstream_factory, sidecar_factory, caplog, monkeypatch
):
    """``Expect: 100-continue`` and the client's close arrives just before the 100 Continue is
    written. The write was made outside the handler's handling of every other end: the
    ConnectionResetError escaped to aiohttp, which logged a traceback ("Error handling
    request") per request, the request was never counted (no SequenceEnded), and its server
    span, already started, was never ended (the trace lost). It is counted client-gone (499)
    and its span ends; the upstream is never asked."""
    up = await upstream_factory(reply(200))
    tracing, exporter = _memory_tracing()
    sc = await sidecar_factory(routes_yaml(up.url), tracing=tracing)
    _close_before_writing(monkeypatch, b"HTTP/1.1 100")
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    assert await asyncio.wait_for(r.read(), 5) == b""
    w.close()
    await _ended(sc)
    assert [(e.fate, e.status) for e in sc.recorder.sequences] == [("client-gone", 499)]
    servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    assert len(servers) == 1
    assert servers[0].attributes and servers[0].attributes["http.response.status_code"] == 499
    assert "Error handling request" not in caplog.text
    assert up.seen == []
    _nothing_kept(sc)


def _close_at_write(n: int) -> Callable[[pytest.MonkeyPatch], None]:
    """The client's close arrives just before the sink's ``n``-th write to it (1: the head,
    or the whole answer in one write; 2: the first body chunk of a streamed one)."""

    def patch(monkeypatch: pytest.MonkeyPatch) -> None:
        real = StreamWriter._write
        writes = [0]

        def write(self: StreamWriter, chunk: Any) -> None:
            writes[0] += 1
            transport = self._protocol.transport
            if writes[0] == n and transport is not None:
                transport.close()
            real(self, chunk)

        monkeypatch.setattr(StreamWriter, "_write", write)

    return patch


_close_at_send_whole = _close_at_write(1)
_close_at_prepare = _close_at_write(1)
_close_at_first_body_write = _close_at_write(2)


@pytest.mark.parametrize(
    ("close", "size"),
    [
        (_close_at_send_whole, 6),
        (_close_at_prepare, 200_000),
        (_close_at_first_body_write, 200_000),
    ],
    ids=["whole-in-one-write", "streamed-before-the-head", "streamed-mid-body"],
)
async def test_a_client_gone_during_the_relay_is_client_gone_however_it_is_noticed(
    upstream_factory,
    sidecar_factory,
    caplog,
    monkeypatch,
    close: Callable[[pytest.MonkeyPatch], None],
    size: int,
):
    """A client that leaves while its answer is relayed is counted client-gone (499) when
    aiohttp's cancellation reaches the handler first. When the close is seen first by a write,
    a small answer sent in one write was logged as an internal error and counted under fate
    ``exhausted`` with a 502, and a streamed one (its head, or a body chunk) was counted as the
    upstream's success with status 200 -- a client that got no response, or a cut one, showed
    as served in ``retry_sidecar_requests_total`` and its span. Either way it is client-gone;
    the upstream's success stands for the breaker, and an unfinished upstream response is
    dropped, not pooled."""
    up = await upstream_factory(reply(200, b"x" * size))
    sc = await sidecar_factory(routes_yaml(up.url))
    close(monkeypatch)
    await _get_as_a_client_that_left(sc, caplog)


async def test_a_client_gone_before_the_sidecars_own_answer_is_written_is_client_gone(
    sidecar_factory, caplog, monkeypatch
):
    """The upstream refuses connections: the sidecar answers 502 itself, and the client's close
    arrives just before that answer is written. The request was counted (502, ``exhausted``)
    before aiohttp wrote the answer, which then found nobody: a client that got nothing showed
    as an answered request. Every answer now goes out through the front end's sink before the
    request ends, so it is client-gone (499), as for a relayed answer; nothing is held."""
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
    _close_before_writing(monkeypatch, b"HTTP/1.1 502")
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    assert await asyncio.wait_for(r.read(), 5) == b""  # nothing written
    w.close()
    await _ended(sc)
    assert [(e.fate, e.status) for e in sc.recorder.sequences] == [("client-gone", 499)]
    assert "internal error" not in caplog.text
    _nothing_kept(sc)


@pytest.mark.parametrize("part", [0, 10], ids=["head-only", "mid-body"])
async def test_a_held_answer_cancelled_half_way_gives_everything_back(
    sidecar_factory, tmp_path, part: int
):
    """A guarded write's answer is held (``proxy/held.py``) until its key is settled. The app
    sends its head and ``part`` bytes of a 100-byte body, then stalls; the write is cancelled
    during the hold, as a stop whose drain ran out cancels it. The upstream response is
    discarded (its connection closed, never pooled), the bulkhead slot given back, the held
    bytes dropped (nothing reaches the client), the request counted once (client-gone), and
    the key settled by the app's head (its status kept, as the app acted)."""
    came = asyncio.Event()

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await read_head(r)
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        await r.readexactly(length)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n" + b"x" * part)
        await w.drain()
        came.set()
        await asyncio.sleep(30)  # stalls mid-body

    async with raw_server(upstream) as port:
        sc = await sidecar_factory(
            routes_yaml(
                f"http://127.0.0.1:{port}",
                "    idempotency: {enabled: true, max_response_bytes: 1KiB}",
                f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}',
            )
        )
        r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(
            b"POST /x HTTP/1.1\r\nHost: x\r\nIdempotency-Key: k1\r\nContent-Length: 2\r\n\r\n{}"
        )
        await asyncio.wait_for(came.wait(), 5)
        await until(lambda: len(sc.recorder.attempts) == 1, "the app's head came")
        for _ in range(5):
            await asyncio.sleep(0)  # the head (and the bytes) reach the hold
        assert len(sc.sidecar.deps.detached) == 1  # the write runs, detached
        await sc.sidecar.deps.detached.stop(0)  # cancelled during the hold
        assert await asyncio.wait_for(r.read(), 5) == b""  # nothing held was sent
        w.close()
        await _ended(sc)
        assert [(e.fate, e.status) for e in sc.recorder.sequences] == [("client-gone", 499)]
        _nothing_kept(sc)
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{sc.sidecar.admin_port}/idempotency/k1"
            async with s.get(url) as resp:
                assert resp.status == 200, await resp.text()
                kept = await resp.json()
        assert kept["state"] == "finished", kept
        assert kept["answer"]["status"] == 200 and not kept["answer"]["body_kept"], kept


async def test_a_client_gone_while_a_hedges_losers_unwind_gives_the_winners_connection_back(
    upstream_factory, sidecar_factory, monkeypatch
):
    """A hedge won: ``hedged`` returns the winner's result from inside ``async with
    AttemptSet()``, whose exit cancels the loser and waits for it to unwind (a loop turn). The
    client's close landing in that turn cancels the handler there: the return value -- the
    winner's result, holding its upstream response -- was dropped on the way out, and nothing
    discarded that response (the AttemptSet had handed it out, the sequence never got it): its
    pooled connection stayed busy for ever, one fewer of ``max_connections`` per occurrence.
    The winner's connection must come back."""
    from sidecar.engine.attempts import AttemptSet  # interpreted (setup.py): patchable

    up = await upstream_factory(hang(30.0), reply(200, b"fast"))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {auto_timeout: {min: 50ms, max: 100ms}}\n    hedge: {enabled: true}\n",
        )
    )
    st = sc.sidecar.states.get("main")
    st.latency.ran_long(sc.sidecar.clock.monotonic())  # a recent slow attempt: hedging armed
    real = AttemptSet.__aexit__

    async def client_leaves_meanwhile(self: AttemptSet, *exc: Any) -> None:
        task = asyncio.current_task()
        if exc[0] is None and self.active and task is not None:
            task.cancel()  # what aiohttp does when the client's close arrives in this turn
        await real(self, *exc)

    monkeypatch.setattr(AttemptSet, "__aexit__", client_leaves_meanwhile)
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
    await asyncio.wait_for(r.read(), 5)
    w.close()
    await _ended(sc)
    assert len(up.seen) == 2  # the original (hanging) and the hedge (answered)
    assert [e.fate for e in sc.recorder.sequences] == ["client-gone"]
    for _ in range(100):
        if st.bulkhead.in_flight == 0 and all(
            p.total == p.idle for p in sc.sidecar.client.stats().values()
        ):
            break
        await asyncio.sleep(0.02)
    _nothing_kept(sc)


async def test_the_deadline_ending_a_wait_for_a_pooled_connection_is_a_deadline(
    upstream_factory, sidecar_factory, client
):
    """The pool is full (one connection, held by a slow request of another route) and the
    request's deadline (300 ms) ends its wait for a connection well before ``wait_timeout``
    (5 s). The wait was reported as the pool staying full -- 503 ``overloaded`` /
    ``pool-exhausted`` -- where the bulkhead's wait cut the same way is a 504 ``deadline``
    (test_ownership.py::test_the_bulkhead_wait_is_charged_to_the_deadline), and Envoy answers
    504 when the route timeout fires while a request waits for a pooled connection. The
    upstream was never asked: nothing is told to the breaker."""
    release = asyncio.Event()

    async def upstream(request: web.Request) -> web.StreamResponse:
        if request.path.startswith("/hold"):
            await release.wait()
        return web.Response(text="ok")

    up = await upstream_factory(upstream)
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    match: {path_prefix: /x}\n    timeout: 300ms\n"
            f'  - name: other\n    upstream: "{up.url}"\n    timeout: 10s\n',
            top_extra="upstream_pool: {max_connections: 1, wait_timeout: 5s}",
        )
    )
    hold = asyncio.create_task(client.get(sc.url + "/hold"))
    while not up.seen:  # the only pooled connection is busy
        await asyncio.sleep(0.01)
    async with client.get(sc.url + "/x") as r:
        assert (r.status, r.headers["x-retry-fate"]) == (504, "deadline")
        assert r.headers["x-retry-proxy-error"] == "deadline"
    release.set()
    (await hold).release()
    assert [s.raw_path for s in up.seen] == ["/hold"]  # /x never reached the upstream
    state = sc.sidecar.states.get("main")
    assert state.breaker.counts(sc.sidecar.clock.monotonic()) == (0, 0)
    _nothing_kept(sc)


async def test_a_record_stored_after_its_client_left_is_counted(
    upstream_factory, sidecar_factory, tmp_path, monkeypatch
):
    """A failed write on a DLQ route is captured; the disk is slow (another process holds the
    write lock) and the client leaves while the record is written. The write goes on -- the
    writer thread runs it whether or not anyone awaits it -- and the record is stored, but
    ``retry_sidecar_dlq_writes_total`` counted only captures awaited to the end: a record in
    the DLQ that no write counts. It is counted once it is stored."""
    import sqlite3

    from sidecar.dlq.store import DlqStore  # interpreted (setup.py): patchable
    from tests.dlq.test_dlq import dlq_yaml, rows

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, retry="{attempts: 1}"))
    capturing = asyncio.Event()
    real = DlqStore.add

    async def add(self: DlqStore, rec: Any) -> str:
        capturing.set()
        return await real(self, rec)

    monkeypatch.setattr(DlqStore, "add", add)
    other = sqlite3.connect(db, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # the writer thread waits for this lock (busy timeout)
    try:
        _r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nab")
        await asyncio.wait_for(capturing.wait(), 5)
        w.transport.abort()  # the client leaves while its record is being written
        await _ended(sc)
        assert [e.fate for e in sc.recorder.sequences] == ["client-gone"]
    finally:
        other.execute("COMMIT")
        other.close()
    line = 'retry_sidecar_dlq_writes_total{route="main",result="stored"} 1'
    for _ in range(100):
        if len(rows(db)) == 1 and line in sc.sidecar.metrics.render():
            break
        await asyncio.sleep(0.02)
    assert [r[1] for r in rows(db)] == ["pending"]
    assert line in sc.sidecar.metrics.render()

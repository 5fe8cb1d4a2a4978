"""Every path owns what it takes: each test ends a request early -- a cancelled waiter, a client
that leaves, a probe that never reached the upstream, a reader that stops reading -- and checks
that the slot, probe, connection and response it held were given back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
from collections.abc import Callable

import aiohttp
import pytest
from aiohttp import web

from sidecar.config.errors import ConfigError
from sidecar.config.model import BreakerPolicy, BulkheadPolicy, UpstreamPool
from sidecar.config.parse import parse_text
from sidecar.core import NoTimeLeft, Overloaded, Verdict
from sidecar.engine.bulkhead import Bulkhead
from sidecar.proxy.admission import is_trusted
from sidecar.retry.breaker import Admitted, Breaker, State
from sidecar.retry.budget import Budget
from sidecar.testing import FakeClock
from sidecar.upstream.pool import Pool
from tests.conftest import hang, reply, routes_yaml
from tests.faults import serve_ok
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

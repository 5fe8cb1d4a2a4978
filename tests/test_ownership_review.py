"""Review of the request path's ownership after the issue-11 rebuild: each test ends a request
on one more path -- an exception after an answer, a stalled body with tracing on, a chunked
upload at the size limits, a pool hand-off under load, an answer relayed to a client that
leaves, bytes the upstream never should have sent -- and checks what was kept or miscounted.

Tests marked ``xfail(strict=True)`` reproduce a defect of the current code (the reason names
it); the others are paths that held up and were not covered before.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
from collections import Counter
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sidecar.config.model import UpstreamPool
from sidecar.core import Verdict
from sidecar.retry.breaker import Admitted, State
from sidecar.retry.budget import Budget
from sidecar.telemetry.tracing import Tracing
from sidecar.upstream.connection import Connection
from sidecar.upstream.pool import Pool
from tests.conftest import reply, routes_yaml
from tests.faults import serve_ok
from tests.rawhttp import raw_request, raw_server, read_head
from tests.test_ownership import open_breaker
from tests.wait import until


def _memory_tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# == defects ======================================================================================

# -- the upstream connection: bytes nobody asked for, arriving with the answer --------------------


async def test_an_unsolicited_response_in_the_same_segment_is_neither_merged_nor_pooled(
    sidecar_factory,
):
    """The upstream answers 200 "ok" and, in the same TCP segment, a second response nobody
    asked for. ``Connection.data_received`` only checks ``complete`` before feeding the parser,
    so httptools parses both messages in one ``feed_data``: the second head overwrites
    ``status`` (503) and appends its headers (two Content-Length values reach the client), the
    sequence retries a request the upstream answered 200 (three sends), and the connection --
    whose state is unknown -- is released to the pool as reusable. nginx relays the first
    response and closes the upstream connection ("upstream sent more data than specified")."""

    async def two_answers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_head(r)
            seen.append(1)
            w.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                b"HTTP/1.1 503 Smuggled\r\nX-Smuggled: yes\r\nContent-Length: 0\r\n\r\n"
            )
            await w.drain()

    seen: list[int] = []
    async with raw_server(two_answers) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 5
        )
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert body == b"ok"
        assert len(re.findall(rb"(?im)^content-length:", head)) == 1, head
        assert b"X-Smuggled" not in head
        assert len(seen) == 1  # answered once: nothing to retry
        # A connection that spoke out of turn is closed, never pooled.
        assert all(p.total == 0 for p in sc.sidecar.client.stats().values())


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


# == paths that held up ==========================================================================


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


async def test_head_204_and_304_answers_leave_the_connection_reusable(sidecar_factory):
    """Bodiless answers whose head announces a length (HEAD, 304) or none (204): the exchange is
    complete at the head, the client gets no body, and the one upstream connection is reused
    for every request."""
    connections = [0]

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections[0] += 1
        while True:
            head = await read_head(r)
            if head.startswith(b"HEAD"):
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            elif b"/204" in head:
                w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            elif b"/304" in head:
                w.write(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1000\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await w.drain()

    async with raw_server(upstream) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        async with aiohttp.ClientSession() as s:
            for method, path, status, body in (
                ("HEAD", "/h", 200, b""),
                ("GET", "/204", 204, b""),
                ("GET", "/304", 304, b""),
                ("GET", "/ok", 200, b"ok"),
                ("HEAD", "/h", 200, b""),
                ("GET", "/ok", 200, b"ok"),
            ):
                async with s.request(method, sc.url + path) as r:
                    assert (r.status, await r.read()) == (status, body)
        assert connections[0] == 1
        assert [(p.total, p.idle) for p in sc.sidecar.client.stats().values()] == [(1, 1)]


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

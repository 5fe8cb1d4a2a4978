"""The paths that end early, third review: a client whose close is seen by a write before
aiohttp cancels the handler (uvloop marks the transport closing at once and calls
``connection_lost`` -- which cancels the handler -- a loop turn later), at each write the
handler makes; and the other early exits read and tried.

The client's close is put just before a write by a patch on an interpreted class (aiohttp's
``StreamWriter``, the sidecar's ``ProxyResponse``): the race itself cannot be timed from a test.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp import web
from aiohttp.http_writer import StreamWriter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sidecar.proxy.respond import ProxyResponse
from sidecar.telemetry.tracing import Tracing
from tests.conftest import Running, hang, reply, routes_yaml
from tests.rawhttp import raw_server, read_head


def _memory_tracing() -> tuple[Tracing, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return Tracing(provider), exporter


def _close_before_writing(monkeypatch: pytest.MonkeyPatch, starting: bytes) -> None:
    """The client's close arrives just before the handler writes bytes starting with
    ``starting`` through aiohttp's writer (a 100 Continue, a relayed 1xx)."""
    real = StreamWriter.write

    async def write(self: StreamWriter, chunk: Any, *args: Any, **kwargs: Any) -> None:
        if bytes(chunk).startswith(starting) and self.transport is not None:
            self.transport.close()
        await real(self, chunk, *args, **kwargs)

    monkeypatch.setattr(StreamWriter, "write", write)


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


# == defects ======================================================================================


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


def _close_at_prepare(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ProxyResponse.prepare

    async def prepare(self: ProxyResponse, request: web.BaseRequest) -> Any:
        assert request.transport is not None
        request.transport.close()
        return await real(self, request)

    monkeypatch.setattr(ProxyResponse, "prepare", prepare)


def _close_at_first_body_write(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ProxyResponse.write

    async def write(self: ProxyResponse, data: Any) -> None:
        req = self._req
        assert req is not None and req.transport is not None
        req.transport.close()
        await real(self, data)

    monkeypatch.setattr(ProxyResponse, "write", write)


def _close_at_send_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ProxyResponse.send_whole

    def send_whole(self: ProxyResponse, request: web.BaseRequest, body: bytes) -> None:
        assert request.transport is not None
        request.transport.close()
        real(self, request, body)

    monkeypatch.setattr(ProxyResponse, "send_whole", send_whole)


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
    from tests.test_dlq import dlq_yaml, rows

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

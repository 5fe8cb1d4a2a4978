"""Two minimal "floor" proxies: what relaying a request costs before any retry logic runs.

    python3 -m bench.floor aiohttp  --listen PORT --upstream PORT
    python3 -m bench.floor protocol --listen PORT --upstream PORT

Both listen on 127.0.0.1, run on uvloop, and send every request to one upstream on 127.0.0.1
through the sidecar's own upstream client (``sidecar.upstream.client.UpstreamClient``: its
pooled keep-alive connections and httptools response parser). They relay the status, the
upstream's headers minus the hop-by-hop ones (RFC 9110 section 7.6.1, with those that
``Connection`` names) and the body. No routes, retries, breaker, budget, metrics, logs or
traces: bench/perf.py runs them next to the sidecar, so the difference is what those cost.

- ``aiohttp``: aiohttp's low-level ``web.Server`` (no router, ``access_log=None``, handler
  cancellation on, as the sidecar runs it) answering ``web.Response``. It is the floor of the
  architecture the sidecar keeps: no sidecar built on aiohttp's server can cost less per
  request than this.
- ``protocol``: the lever that removes aiohttp's per-request server machinery (its request and
  response objects, header multidicts, payload writer, per-connection task juggling): a plain
  ``asyncio.Protocol`` parsing requests with ``httptools.HttpRequestParser`` and writing each
  answer's head and body in one ``transport.write``.

What they are not, on purpose (they are measuring instruments, not products):

- GET only: any other method is answered 501 (its body read and dropped), a GET's body is
  dropped, ``Upgrade`` is never relayed.
- The whole upstream body is buffered before the answer is written (fine for the benchmark's
  small replies; no streaming, no 1 MiB runs).
- ``protocol`` serves one request at a time per connection: requests a client pipelines
  are queued (reading pauses at MAX_QUEUED of them, or while the client does not read its
  answers) and answered in order. A request head over 64 KiB gets 431, a malformed one 400,
  then the connection closes. A connection with no request in flight for KEEPALIVE_TIMEOUT seconds
  is closed (one sweep a second; a partly received head counts as idle).
- ``aiohttp`` re-encodes relayed header values through ``str`` (latin-1 in, aiohttp's encoding
  out) and adds ``Content-Type: application/octet-stream`` when the upstream sent none; the
  sidecar writes the upstream's header bytes as they came.
- Upstream failures are answered 502 (504 for a timeout, 503 when the pool is exhausted);
  nothing is retried.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from typing import Protocol

import httptools
from aiohttp import web
from multidict import CIMultiDict

from sidecar.core import AttemptTimeout, LocalOverload, UpstreamError
from sidecar.proxy.forward import HOP_BY_HOP
from sidecar.upstream.client import UpstreamClient

HOST = "127.0.0.1"
UPSTREAM_TIMEOUT = 10.0  # connect + response head, per request
BODY_IDLE_TIMEOUT = 10.0  # between upstream body bytes
KEEPALIVE_TIMEOUT = 75.0  # aiohttp's and nginx's default
MAX_HEAD = 64 * 1024  # request line + headers, ``protocol`` only
MAX_QUEUED = 16  # pipelined requests a ``protocol`` connection holds before it stops reading

Headers = list[tuple[bytes, bytes]]

# The hop-by-hop fields are the sidecar's own list (the floors drop what it drops).
# Content-Length is re-framed by the floor proxy itself: the relayed body is whole.
DROPPED = HOP_BY_HOP | {b"content-length"}


def relay_headers(raw: Headers) -> Headers:
    """``raw`` minus hop-by-hop fields, those ``Connection`` names, and Content-Length."""
    dropped = DROPPED
    for k, v in raw:
        if len(k) == 10 and k.lower() == b"connection":
            named = {t.strip().lower() for t in v.split(b",")} - {b"host", b""}
            dropped = dropped | named
    return [(k, v) for k, v in raw if k.lower() not in dropped]


def upstream_head(target: bytes, headers: Headers) -> bytes:
    """A GET request head for the upstream: the client's target and relayable headers."""
    parts = [b"GET ", target, b" HTTP/1.1\r\n"]
    for k, v in relay_headers(headers):
        parts += (k, b": ", v, b"\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    headers: Headers
    body: bytes


def error_answer(status: int, message: str) -> Answer:
    return Answer(status, [(b"content-type", b"text/plain")], message.encode() + b"\n")


async def fetch(client: UpstreamClient, port: int, head: bytes) -> Answer:
    """One exchange with the upstream; its response is given back to the pool on every exit."""
    try:
        up = await client.request(HOST, port, head, None, UPSTREAM_TIMEOUT)
    except AttemptTimeout:
        return error_answer(504, "upstream timed out")
    except UpstreamError as exc:
        return error_answer(502, f"upstream failed: {type(exc).__name__}")
    except LocalOverload:
        return error_answer(503, "no upstream connection free")
    try:
        if up.complete:
            body = up.take_body()
        else:
            chunks = []
            while chunk := await up.read_chunk(BODY_IDLE_TIMEOUT):
                chunks.append(chunk)
            body = b"".join(chunks)
    except UpstreamError as exc:
        up.discard()
        return error_answer(502, f"upstream body failed: {type(exc).__name__}")
    except BaseException:
        up.discard()  # cancelled (the client went away) or a bug: the connection is dropped
        raise
    up.release()
    return Answer(up.status, relay_headers(up.headers), body)


class Floor(Protocol):
    """A running floor proxy."""

    port: int
    client: UpstreamClient

    async def close(self) -> None: ...


# -- aiohttp -----------------------------------------------------------------------------------


class AiohttpFloor:
    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.client = UpstreamClient()
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._web = web.Server(self.handle, access_log=None, handler_cancellation=True)

    async def start(self, listen: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._web, HOST, listen)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if request.method != "GET":
            return web.Response(status=501, text=f"{request.method} is not relayed (GET only)\n")
        target = request.raw_path.encode("utf-8", "surrogateescape")
        a = await fetch(
            self.client, self.upstream, upstream_head(target, list(request.raw_headers))
        )
        headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in a.headers)
        return web.Response(status=a.status, body=a.body, headers=headers)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        await self._web.shutdown(1.0)
        if self._server is not None:
            await self._server.wait_closed()
        self.client.close()


# -- asyncio.Protocol + httptools ----------------------------------------------------------------

_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def response_bytes(a: Answer, keep_alive: bool, http10: bool) -> bytes:
    """The whole answer, head and body, as one buffer."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (a.status, _REASONS.get(a.status, b""))]
    for k, v in a.headers:
        parts += (k, b": ", v, b"\r\n")
    if a.status not in (204, 304):
        parts.append(b"content-length: %d\r\n" % len(a.body))
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    elif http10:
        parts.append(b"connection: keep-alive\r\n")
    parts += (b"\r\n", a.body)
    return b"".join(parts)


@dataclass(slots=True)
class Pending:
    """A request received whole, waiting for its answer; ``error`` is a status to answer
    without asking the upstream (the connection closes after it)."""

    method: bytes
    target: bytes
    headers: Headers
    keep_alive: bool
    http10: bool
    error: int = 0


class _HeadTooLarge(Exception):
    pass


class FloorConnection(asyncio.Protocol):
    """One client connection. It owns its worker task (cancelled when the client goes away)
    and its pending requests; the worker owns each upstream exchange (``fetch``)."""

    def __init__(self, floor: ProtocolFloor) -> None:
        self._floor = floor
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._target = b""
        self._headers: Headers = []
        self._head_bytes = 0
        self._current: Pending | None = None
        self._queue: deque[Pending] = deque()
        self._task: asyncio.Task[None] | None = None
        self._closing = False  # a request asked to close, or the head was bad: read no more
        self._write_paused = False
        self._read_paused = False
        self.idle_since = self._loop.time()

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        self._floor.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._closing:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # The upgrading request is queued whole; what follows is another protocol.
            self._closing = True
            if self._queue:
                self._queue[-1].keep_alive = False
        except httptools.HttpParserError as exc:
            if not self._closing:
                too_large = isinstance(exc.__context__, _HeadTooLarge)
                self._queue.append(Pending(b"", b"", [], False, False, 431 if too_large else 400))
                self._closing = True
                self._kick()

    def pause_writing(self) -> None:
        self._write_paused = True
        self._flow()

    def resume_writing(self) -> None:
        self._write_paused = False
        self._flow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        self._floor.connections.discard(self)
        if self._task is not None:
            self._task.cancel()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._target = b""
        self._headers = []
        self._head_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._target += url
        self._count(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))
        self._count(len(name) + len(value) + 4)

    def on_headers_complete(self) -> None:
        p = self._parser
        self._current = Pending(
            p.get_method(),
            self._target,
            self._headers,
            p.should_keep_alive(),
            p.get_http_version() == "1.0",
        )

    def on_message_complete(self) -> None:
        req = self._current
        assert req is not None
        self._current = None
        self._queue.append(req)
        if not req.keep_alive:
            self._closing = True
        self._kick()

    # the worker

    def _count(self, n: int) -> None:
        self._head_bytes += n
        if self._head_bytes > MAX_HEAD:
            raise _HeadTooLarge

    def _kick(self) -> None:
        if self._task is None:
            self._task = self._loop.create_task(self._serve())
        self._flow()

    def _flow(self) -> None:
        """Read while the client reads its answers and few requests wait (no pause/resume
        per request: each costs the event loop a poller update)."""
        pause = self._write_paused or len(self._queue) >= MAX_QUEUED
        t = self._transport
        if pause != self._read_paused and t is not None and not t.is_closing():
            self._read_paused = pause
            if pause:
                t.pause_reading()
            else:
                t.resume_reading()

    async def _serve(self) -> None:
        transport = self._transport
        assert transport is not None
        try:
            while self._queue:
                req = self._queue[0]
                if req.error:
                    answer = error_answer(req.error, HTTPStatus(req.error).phrase)
                elif req.method != b"GET":
                    answer = error_answer(501, f"{req.method.decode()} is not relayed (GET only)")
                else:
                    head = upstream_head(req.target, req.headers)
                    answer = await fetch(self._floor.client, self._floor.upstream, head)
                self._queue.popleft()
                if transport.is_closing():
                    return
                transport.write(response_bytes(answer, req.keep_alive, req.http10))
                if not req.keep_alive:
                    transport.close()
                    return
                self._flow()
            self.idle_since = self._loop.time()
        finally:
            self._task = None

    @property
    def idle(self) -> bool:
        return self._task is None

    def close(self) -> asyncio.Task[None] | None:
        """Close the connection; returns the worker, cancelled, for the caller to await."""
        self._closing = True
        if self._transport is not None:
            self._transport.close()
        task = self._task
        if task is not None:
            task.cancel()
        return task


class ProtocolFloor:
    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.client = UpstreamClient()
        self.port = 0
        self.connections: set[FloorConnection] = set()
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, listen: int) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: FloorConnection(self), HOST, listen)
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._sweeper = loop.create_task(self._sweep())

    async def _sweep(self) -> None:
        """Close connections idle for KEEPALIVE_TIMEOUT (one timer for all, not one per
        request)."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(1.0)
            cutoff = loop.time() - KEEPALIVE_TIMEOUT
            for c in [c for c in self.connections if c.idle and c.idle_since < cutoff]:
                c.close()

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        workers = [t for c in list(self.connections) if (t := c.close()) is not None]
        if self._sweeper is not None:
            workers.append(self._sweeper)
        # Cancelled workers give back their upstream exchanges before the pool closes.
        await asyncio.gather(*workers, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
        self.client.close()


# -- running -----------------------------------------------------------------------------------


async def start(kind: str, listen: int, upstream: int) -> Floor:
    """Start a floor proxy of ``kind`` ("aiohttp" or "protocol") on 127.0.0.1:``listen``
    (0: any free port, read it from ``.port``)."""
    floor: AiohttpFloor | ProtocolFloor
    if kind == "aiohttp":
        floor = AiohttpFloor(upstream)
    elif kind == "protocol":
        floor = ProtocolFloor(upstream)
    else:
        raise ValueError(f"unknown floor proxy {kind!r}")
    await floor.start(listen)
    return floor


async def serve(kind: str, listen: int, upstream: int) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    floor = await start(kind, listen, upstream)
    try:
        print(f"floor-{kind} listening on {HOST}:{floor.port}", file=sys.stderr, flush=True)
        await stop.wait()
    finally:
        await floor.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python3 -m bench.floor",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("kind", choices=("aiohttp", "protocol"))
    ap.add_argument("--listen", type=int, required=True, help="port on 127.0.0.1")
    ap.add_argument("--upstream", type=int, required=True, help="upstream port on 127.0.0.1")
    args = ap.parse_args(argv)
    import uvloop

    result: int = uvloop.run(serve(args.kind, args.listen, args.upstream))
    return result


if __name__ == "__main__":
    raise SystemExit(main())

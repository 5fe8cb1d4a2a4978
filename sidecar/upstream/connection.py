"""One upstream HTTP/1.1 connection: an asyncio Protocol with httptools' C parser.

A new parser is made for every response, so no state leaks from one exchange to the next, and a
HEAD response (whose Content-Length describes a body that never comes) simply ends at its head.
Body bytes are queued with flow control: reading pauses above HIGH_WATER buffered bytes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import httptools

from sidecar.core import AttemptTimeout, UpstreamError, UpstreamReset

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024
MAX_RESPONSE_HEAD = 64 * 1024
MAX_RESPONSE_HEADERS = 200


class Connection(asyncio.Protocol):
    __slots__ = (
        "_body_buffered",
        "_drain_waiter",
        "_head_bytes",
        "_informational",
        "_loop",
        "_parser",
        "_paused",
        "_timer",
        "_waiter",
        "_write_paused",
        "body",
        "closed",
        "complete",
        "eof_delimited",
        "error",
        "head_only",
        "headers",
        "headers_done",
        "idle_handle",
        "keep_alive",
        "key",
        "status",
        "transport",
    )

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int]) -> None:
        self._loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self._parser: Any = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.idle_handle: asyncio.TimerHandle | None = None
        self.closed = False
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.complete = False
        self.keep_alive = False
        self.head_only = False
        self.eof_delimited = False
        self.error: UpstreamError | None = None
        self.body: deque[bytes] = deque()
        self._body_buffered = 0
        self._head_bytes = 0
        self._informational = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check here.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self._parser is None or self.complete:
            # Bytes nobody asked for (an idle connection, or after a complete response):
            # the connection is no longer in a known state.
            self._fail(UpstreamReset("unsolicited bytes from upstream"))
            self.close()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamReset("upstream tried to upgrade the connection"))
            self.close()
        except httptools.HttpParserError as exc:
            self._fail(UpstreamReset(f"malformed response from upstream: {exc}"))
            self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._cancel_timer()
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None
        if self._parser is not None and not self.complete and self.error is None:
            if self.headers_done and self.eof_delimited and exc is None:
                self.complete = True
            elif self.headers_done:
                self.error = UpstreamReset("upstream closed the connection mid-body")
            else:
                self.error = UpstreamReset("upstream closed the connection before a response")
        self._wake()
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(UpstreamReset("upstream closed while sending"))

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        w = self._drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > MAX_RESPONSE_HEAD or len(self.headers) >= MAX_RESPONSE_HEADERS:
            raise UpstreamReset("response head too large")
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            # 1xx informational: dropped; the real response follows on the same connection.
            self._informational = True
            self.headers = []
            self._head_bytes = 0
            return
        self.status = status
        self.keep_alive = bool(self._parser.should_keep_alive())
        self.headers_done = True
        if not self.head_only and status not in (204, 304):
            framed = False
            for name, value in self.headers:
                lname = name.lower()
                if lname == b"content-length" or (
                    lname == b"transfer-encoding" and b"chunked" in value.lower()
                ):
                    framed = True
                    break
            self.eof_delimited = not framed
        if self.head_only:
            self.complete = True
        self._cancel_timer()
        self._wake()

    def on_body(self, data: bytes) -> None:
        if self.complete:
            return
        self.body.append(data)
        self._body_buffered += len(data)
        if not self._paused and self._body_buffered > HIGH_WATER and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self.complete = True
        self._wake()

    # -- used by the client ------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        return self._body_buffered

    def usable(self) -> bool:
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    def begin(self, head_only: bool) -> None:
        """Prepare for one request/response exchange."""
        self._reset_exchange()
        self.head_only = head_only
        self._parser = httptools.HttpResponseParser(self)

    def write(self, data: bytes) -> None:
        assert self.transport is not None
        self.transport.write(data)

    async def drain(self, idle_timeout: float) -> None:
        """Wait until the upstream takes more bytes; an upstream that takes none for
        ``idle_timeout`` has stalled (AttemptTimeout)."""
        if self.closed:
            raise self.error or UpstreamReset("upstream closed while sending")
        if not self._write_paused:
            return
        waiter = self._drain_waiter = self._loop.create_future()
        timer = self._loop.call_later(idle_timeout, _stall, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._drain_waiter = None

    async def wait_head(self, timeout: float) -> None:
        """Until the response head is parsed; raises AttemptTimeout or UpstreamReset."""
        if timeout <= 0:
            raise AttemptTimeout("no time left for the attempt")
        self._timer = self._loop.call_later(timeout, self._on_timeout)
        try:
            while not self.headers_done:
                if self.error is not None:
                    raise self.error
                await self._wait()
        finally:
            self._cancel_timer()

    async def read_chunk(self, idle_timeout: float) -> bytes:
        """The next body bytes; b"" at the end. Raises UpstreamReset if the body broke."""
        while True:
            if self.body:
                data = self.body.popleft()
                self._body_buffered -= len(data)
                if self._paused and self._body_buffered < LOW_WATER and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.complete:
                return b""
            if self.error is not None:
                raise self.error
            self._timer = self._loop.call_later(idle_timeout, self._on_timeout)
            try:
                await self._wait()
            finally:
                self._cancel_timer()

    def reusable(self) -> bool:
        return (
            self.complete
            and self.keep_alive
            and self.error is None
            and not self.body
            and self.usable()
        )

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.closed = True

    # -- internals ---------------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
        self._wake()

    def _on_timeout(self) -> None:
        self._timer = None
        if self.headers_done:
            self._fail(UpstreamReset("upstream body stalled past the idle timeout"))
        else:
            self._fail(AttemptTimeout("no response head within the per-try timeout"))
        self.abort()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _stall(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(AttemptTimeout("the upstream stopped reading the request body"))

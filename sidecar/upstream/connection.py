"""One upstream HTTP/1.1 connection: an asyncio Protocol with httptools' C parser, driven by
the explicit state machine of ``states`` (request side, response side, link).

A new parser is made for every exchange, so no parser state leaks from one to the next. What
the upstream sends is checked as nginx and RFC 9110/9112 want it:

- bytes after a complete response (a second status line in the same read, or anything else)
  are dropped and the connection is closed, never pooled ("upstream sent more data");
- a status outside 100-599, a transfer coding other than ``chunked``, or a head over
  its bounds is a ``BadResponse`` (not retried; ``responsehead`` judges the head);
- 1xx interim responses other than 100 are kept (in order) for the handler to relay;
- trailer fields of a chunked body are read and dropped, never merged into the head;
- a final response that arrives while the request body is still being sent (an early answer)
  is noticed at once: ``answered`` turns true and a blocked ``drain`` returns.

Body bytes are queued with flow control: reading pauses above HIGH_WATER buffered bytes.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import httptools

from sidecar.core import AttemptTimeout, BadResponse, BodyTimeout, UpstreamError, UpstreamReset
from sidecar.upstream.responsehead import (
    MAX_INTERIM,
    MAX_RESPONSE_HEAD,
    Headers,
    check_field,
    check_final_status,
    read_fields,
)
from sidecar.upstream.states import ConnState, Link, Req, Resp
from sidecar.upstream.tls import TlsTarget, alert_after_handshake

HIGH_WATER = 256 * 1024
LOW_WATER = 64 * 1024


class _ExtraData(Exception):
    """Raised inside a parser callback to stop parsing bytes after a complete response."""


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
        "_trailer_bytes",
        "_waiter",
        "_write_paused",
        "body",
        "content_length",
        "eof_delimited",
        "error",
        "extra_data",
        "head_only",
        "headers",
        "idle_handle",
        "interim",
        "key",
        "proxy_error",
        "retry_after",
        "session_pending",
        "state",
        "status",
        "tls",
        "transport",
        "tunnel_bytes",
        "upgrade",
    )

    def __init__(
        self, loop: asyncio.AbstractEventLoop, key: tuple[str, int], tls: TlsTarget | None = None
    ) -> None:
        self._loop = loop
        self.key = key
        self.tls = tls  # over TLS: its identity; the session is kept after the first exchange
        self.session_pending = tls is not None
        self.transport: asyncio.Transport | None = None
        self.state = ConnState()
        self._parser: Any = None
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._paused = False
        self._timer: asyncio.TimerHandle | None = None
        self.idle_handle: asyncio.TimerHandle | None = None
        self.upgrade = False  # this exchange asks for an Upgrade: a 101 is its answer
        # After a 101 that was asked for: the bytes of the new protocol read so far, kept for
        # the tunnel (proxy/tunnel.py), which then takes the transport over.
        self.tunnel_bytes: bytearray | None = None
        self._reset_exchange()

    def _reset_exchange(self) -> None:
        self.status = 0
        self.headers: Headers = []
        self.interim: list[tuple[int, Headers]] = []
        self.head_only = False
        self.content_length: int | None = None  # announced by the response (not chunked)
        # Fields the retry engine reads, noted in the one pass over the head made for framing.
        self.retry_after: bytes | None = None
        self.proxy_error: bytes | None = None  # x-retry-proxy-error of an inner sidecar
        self.eof_delimited = False
        self.extra_data = False
        self.error: UpstreamError | None = None
        self.body: deque[bytes] = deque()
        self._body_buffered = 0
        self._head_bytes = 0
        self._trailer_bytes = 0
        self._informational = False

    # -- what the state says -----------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self.state.link is Link.CLOSED

    @property
    def headers_done(self) -> bool:
        return self.state.resp in (Resp.BODY, Resp.DONE)

    def has_answer(self) -> bool:
        """The final response head has arrived (possibly while the request is still sent).
        A method, not a property: it changes while a caller awaits."""
        return self.headers_done

    @property
    def complete(self) -> bool:
        """The whole response has arrived and nothing broke it."""
        return self.state.resp is Resp.DONE and self.error is None

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport, so no isinstance check here.
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.tunnel_bytes is not None:
            self.tunnel_bytes += data
            return
        resp = self.state.resp
        if resp is Resp.IDLE:
            # Bytes nobody asked for (an idle pooled connection): its state is unknown.
            self._fail(UpstreamReset("unsolicited bytes from upstream"))
            self.close()
            return
        if resp is Resp.DONE:
            self._extra()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade as switched:
            tail = self._switched_to()  # set by the callbacks this feed ran
            if tail is not None:  # the 101 asked for: the rest is the new protocol's
                offset = switched.args[0] if switched.args else len(data)
                tail += data[offset:]
                return
            self._fail(
                BadResponse("upstream tried to upgrade the connection", "http_upgrade_failed")
            )
            self.close()
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, _ExtraData):
                self._extra()
            elif isinstance(cause, UpstreamError):
                self._fail(cause)
                self.close()
            else:
                self._fail(UpstreamReset(f"malformed response from upstream: {exc}"))
                self.close()
        # not "exc": see tests/integration/test_build.py (mypyc)
        except httptools.HttpParserError as bad:
            if self.state.resp is Resp.DONE:
                self._extra()  # garbage after a complete response
            else:
                self._fail(UpstreamReset(f"malformed response from upstream: {bad}"))
                self.close()

    def eof_received(self) -> bool:
        return False  # close the transport; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        if self.idle_handle is not None:
            self.idle_handle.cancel()
            self.idle_handle = None
        resp = self.state.resp
        if resp is Resp.BODY and self.error is None:
            if self.eof_delimited and exc is None:
                self.state.response(Resp.DONE)  # the close is the end of this body
                self.state.to_link(Link.MUST_CLOSE)
            else:
                self._fail(UpstreamReset("upstream closed the connection mid-body"))
        elif resp is Resp.AWAITING_HEAD and self.error is None:
            refused = None
            if self.session_pending and self.tls is not None:  # the first exchange over TLS
                refused = alert_after_handshake(exc, self.tls)
            self._fail(refused or UpstreamReset("upstream closed the connection before a response"))
        self.state.to_link(Link.CLOSED)
        self._wake()
        self._wake_drain(UpstreamReset("upstream closed while sending"))
        # The parser holds bound methods of this connection and the connection holds the
        # parser: a cycle only the garbage collector would free. No bytes come after this.
        self._parser = None

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        self._wake_drain(None)

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.state.resp is Resp.DONE:
            raise _ExtraData  # a second response after a complete one

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.state.resp is Resp.BODY:
            # A trailer field of a chunked body: read, bounded, dropped (never merged into the
            # head that already went to the client; RFC 9110 section 6.5).
            self._trailer_bytes += len(name) + len(value) + 4
            if self._trailer_bytes > MAX_RESPONSE_HEAD:
                raise UpstreamReset("response trailers too large")
            return
        self._head_bytes += len(name) + len(value) + 4
        check_field(self._head_bytes, len(self.headers))
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status == 101:
            if not self.upgrade or not any(n.lower() == b"upgrade" for n, _ in self.headers):
                # Upgrade is sent upstream only by a tunnel (proxy/tunnel.py), and a 101
                # must name the protocol switched to (RFC 9110 section 15.2.2).
                raise BadResponse("upstream switched protocols unasked", "http_upgrade_failed")
            # The switch asked for: the response ends with its head, the connection is the
            # tunnel's from here (never pooled), and what follows is not HTTP.
            self.status = status
            self.tunnel_bytes = bytearray()
            self.state.to_link(Link.MUST_CLOSE)
            self.state.response(Resp.DONE)
            self._cancel_timer()
            self._wake()
            return
        if 100 <= status < 200:
            # Interim: the final response follows on the same connection. 100 Continue is
            # dropped (the sidecar answers Expect itself and never sends one upstream).
            self._informational = True
            if status != 100:
                if len(self.interim) >= MAX_INTERIM:
                    raise BadResponse("too many 1xx responses", "http_protocol_error")
                self.interim.append((status, self.headers))
            self.headers = []
            self._head_bytes = 0
            return
        check_final_status(status)
        fields = read_fields(self.headers)
        self.content_length = fields.content_length
        self.retry_after = fields.retry_after
        self.proxy_error = fields.proxy_error
        self.status = status
        if not self._parser.should_keep_alive():
            self.state.to_link(Link.MUST_CLOSE)
        if self.head_only or status in (204, 304):
            self.state.response(Resp.DONE)
        else:
            self.eof_delimited = not fields.framed
            self.state.response(Resp.BODY)
        self._cancel_timer()
        self._wake()
        self._wake_drain(None)  # an early answer ends a blocked upload at once

    def on_body(self, data: bytes) -> None:
        if self.state.resp is Resp.DONE:
            raise _ExtraData  # a body after a head-only response
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
        if self.state.resp is Resp.BODY:
            self.state.response(Resp.DONE)
        self._cancel_timer()
        self._wake()

    # -- used by the client ------------------------------------------------------------------

    @property
    def buffered(self) -> int:
        return self._body_buffered

    def usable(self) -> bool:
        return (
            self.state.link is Link.OPEN
            and self.transport is not None
            and not self.transport.is_closing()
        )

    def begin(self, head_only: bool, upgrade: bool = False) -> None:
        """Prepare for one request/response exchange (``upgrade``: it asks for a switch)."""
        if self.state.req is not Req.IDLE:
            self.state.next_exchange()  # raises unless the last exchange ended cleanly
        self._reset_exchange()
        self.head_only = head_only
        self.upgrade = upgrade
        self._parser = httptools.HttpResponseParser(self)
        self.state.begin()

    def write(self, data: bytes) -> None:
        transport = self.transport
        assert transport is not None and self.state.req is Req.SENDING
        if transport.is_closing():
            # uvloop raises RuntimeError on a write to a closed transport (asyncio drops it):
            # the upstream's close is a reset of this exchange, never an internal fault.
            raise self.error or UpstreamReset("upstream closed while the request was sent")
        transport.write(data)

    def request_sent(self) -> None:
        self.state.request(Req.SENT)

    def abandon_request(self) -> None:
        """Stop sending: the upstream answered early. The connection is never reused."""
        if self.state.req is Req.SENDING:
            self.state.request(Req.ABANDONED)
        self.state.to_link(Link.MUST_CLOSE)

    async def drain(self, idle_timeout: float) -> None:
        """Wait until the upstream takes more bytes (or answers early); an upstream that takes
        none for ``idle_timeout`` has stalled (AttemptTimeout)."""
        if self.closed or self.state.link is Link.BROKEN:
            raise self.error or UpstreamReset("upstream closed while sending")
        if not self._write_paused or self.has_answer():
            return
        waiter = self._drain_waiter = self._loop.create_future()
        timer = self._loop.call_later(idle_timeout, _stall, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._drain_waiter = None

    async def wait_answer(self) -> None:
        """Until the response head arrives or the exchange breaks; no timer (the caller
        bounds it)."""
        while not self.headers_done and self.error is None:
            await self._wait()

    async def wait_head(self, timeout: float) -> None:
        """Until the response head is parsed; raises AttemptTimeout or the exchange's error."""
        if self.headers_done:
            return
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
        """The next body bytes; b"" at the end. Raises the exchange's error if the body broke,
        BodyTimeout when the upstream sends nothing for ``idle_timeout``."""
        while True:
            if self.body:
                data = self.body.popleft()
                self._body_buffered -= len(data)
                if self._paused and self._body_buffered < LOW_WATER and self.transport is not None:
                    self._paused = False
                    self.transport.resume_reading()
                return data
            if self.state.resp is Resp.DONE and self.error is None:
                return b""
            if self.error is not None:
                raise self.error
            self._timer = self._loop.call_later(idle_timeout, self._on_timeout)
            try:
                await self._wait()
            finally:
                self._cancel_timer()

    def reusable(self) -> bool:
        """Both sides ended cleanly, nothing is left unread or unsent (an upstream that
        answered before taking the whole request would otherwise read our leftover bytes as
        the start of the next request)."""
        return (
            self.state.reusable
            and self.error is None
            and not self.body
            and self.usable()
            and self.transport is not None
            and self.transport.get_write_buffer_size() == 0
        )

    def close(self) -> None:
        if self.transport is not None and self.state.link is not Link.CLOSED:
            self.transport.close()
        self._mark_closed()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()
        self._mark_closed()

    # -- internals ---------------------------------------------------------------------------

    def _mark_closed(self) -> None:
        # connection_lost follows from the transport; the state is closed at once so that
        # nothing reuses the connection meanwhile. An unfinished exchange is broken.
        if self.state.resp in (Resp.AWAITING_HEAD, Resp.BODY) and self.error is None:
            self._fail(UpstreamReset("the connection was closed mid-exchange"))
        self.state.to_link(Link.CLOSED)

    def _switched_to(self) -> bytearray | None:
        return self.tunnel_bytes

    def _extra(self) -> None:
        """Bytes after a complete response: drop them and close (nginx: "upstream sent more
        data"); the response already received stays intact."""
        self.extra_data = True
        self.state.to_link(Link.MUST_CLOSE)
        if self.transport is not None:
            self.transport.close()
        self._wake()

    async def _wait(self) -> None:
        waiter = self._waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            # A cancelled earlier waiter (the upload's answer watch) unwinds late: it must not
            # clear the waiter that replaced it.
            if self._waiter is waiter:
                self._waiter = None

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _wake_drain(self, error: UpstreamError | None) -> None:
        w = self._drain_waiter
        if w is not None and not w.done():
            if error is None:
                w.set_result(None)
            else:
                w.set_exception(error)

    def _fail(self, error: UpstreamError) -> None:
        if self.state.resp is Resp.DONE and self.error is None:
            # The response is whole; whatever came after only means "do not reuse".
            self.state.to_link(Link.MUST_CLOSE)
        elif self.error is None:
            self.error = error
            self.state.to_link(Link.BROKEN)
        self._wake()
        self._wake_drain(self.error)

    def _on_timeout(self) -> None:
        self._timer = None
        if self.headers_done:
            self._fail(BodyTimeout("the upstream sent no body bytes within the idle timeout"))
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

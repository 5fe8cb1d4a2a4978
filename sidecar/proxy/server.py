"""The proxy's HTTP server: aiohttp's low-level server with the guards aiohttp lacks.

aiohttp has no deadline for reading a request head (a client trickling one header line per
second stays connected forever) and logs a traceback at ERROR for every malformed request
(a log flood anyone can cause). This module subclasses its connection handler to:

- cut a request head that is not complete within ``limits.header_timeout`` with 408;
- answer malformed requests itself: 431 for a request line or header over 8190 bytes or more
  than 100 header fields, 400 otherwise; JSON body, counted in a metric, logged at a bounded
  rate, never a traceback.

It relies on two aiohttp internals (``RequestHandler.data_received``'s message queue and
``_make_error_handler``), pinned by the version range in pyproject.toml and covered by
tests/proxy/test_hardening.py, which fail if either stops behaving.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import StreamReader, web
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler, _ErrInfo

from sidecar.proxy.framing import RequestFraming, escape_request_line, target_of
from sidecar.proxy.methods import stand_in
from sidecar.proxy.respond import client_error
from sidecar.proxy.tlslisten import accepted_at, xfcc
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.proxy")

MAX_LINE = 8190
MAX_FIELD = 8190
MAX_HEADERS = 100
_VERSIONS = (HttpVersion10, HttpVersion11)


def _error_bytes(answer: web.Response, reason: str) -> bytes:
    """A refusal written straight to the socket (no handler is running): ``answer``'s status,
    headers and body, closing the connection."""
    assert isinstance(answer.body, bytes)
    head = [f"HTTP/1.1 {answer.status} {reason}"]
    head += [
        f"{k}: {v}"
        for k, v in answer.headers.items()
        if k.lower() not in ("content-length", "connection")
    ]
    head += [f"Content-Length: {len(answer.body)}", "Connection: close"]
    return ("\r\n".join(head) + "\r\n\r\n").encode() + answer.body


def transport_peer(transport: asyncio.BaseTransport | None) -> str:
    """The peer's address on ``transport``, or "" when it has none (gone, or a Unix socket)."""
    if transport is None:
        return ""
    peer = transport.get_extra_info("peername")
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return ""


def _parser_switches(msg: RawRequestMessage) -> bool:
    """Whether aiohttp's parser leaves HTTP after this request (the bytes after it are kept
    for a tunnel, or parsed again by aiohttp itself if none opens): a ``websocket`` upgrade or
    CONNECT, and nothing else. Any other ``Upgrade`` (h2c...) stays HTTP to the parser, so the
    framing goes on cutting: fed together with the request's body, a request pipelined after
    it was dropped by the parser's pause at the end of the upgrade request."""
    if msg.method == "CONNECT":
        return True
    value = msg.headers.get("Upgrade", "")
    return msg.upgrade and value.isascii() and value.lower() == "websocket"


class TunnelEnd(Protocol):
    """What a tunnel (proxy/tunnel.py) hears of the client connection it took over."""

    def feed_data(self, data: bytes) -> tuple[bool, bytes]: ...

    def client_eof(self) -> None: ...

    def client_drained(self) -> None: ...


class GuardedRequestHandler(RequestHandler):
    """One client connection of the proxy listener."""

    def __init__(self, manager: SidecarServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = manager
        self._head_timer: asyncio.TimerHandle | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._last_payload: StreamReader | None = None  # the body of the last request head
        self.in_request = False
        self._framing = RequestFraming()
        self._held = b""  # bytes read while the parser kept some of its own (body reader full)
        self._chunked_open = False  # the last head's chunked body has not ended yet
        self.draining = False  # the listener is shutting down (``SidecarServer.pre_shutdown``)
        self._line = b""  # the request line being received, as sent
        self._peer = ""  # the client's address, read once per connection
        self.tunnel: TunnelEnd | None = None  # set while an upgraded connection is relayed
        self._method: str | None = None  # the method stood in for in the head being parsed
        self._heard = False  # a byte has come on this connection
        self.tls: ssl.SSLObject | None = None  # the TLS listener's connection (proxy/tlslisten)
        self._xfcc: bytes | None = None  # its client certificate as XFCC, once asked

    def peer(self) -> str:
        """The client's address. Kept for the connection's life: uvloop asks the kernel
        (getpeername) on every ``get_extra_info("peername")``, and every request needs it."""
        if not self._peer:
            self._peer = transport_peer(self.transport)
        return self._peer

    def client_cert(self) -> bytes | None:
        """The client certificate of this TLS connection as Envoy's XFCC value, read once per
        connection; None without one (plaintext, or no certificate asked for)."""
        if self._xfcc is None:
            der = self.tls.getpeercert(binary_form=True) if self.tls is not None else None
            self._xfcc = xfcc(der) if der else b""
        return self._xfcc or None

    # -- the head deadline ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        """The first head's deadline runs from accept (as nginx's ``client_header_timeout``):
        a connection that never sends a byte is closed after ``limits.header_timeout``, not
        held until ``keepalive_timeout``."""
        super().connection_made(transport)
        timeout = self._guard.header_timeout()
        self.tls = transport.get_extra_info("ssl_object")
        if self.tls is not None:  # over TLS: the handshake took part of the head's time
            timeout = max(0.0, timeout - (time.monotonic() - accepted_at(self.tls)))
        self._head_timer = self._loop.call_later(timeout, self._head_timed_out)

    def data_received(self, data: bytes) -> None:
        """Hand the parser one request at a time (``framing.RequestFraming``): a request
        that closes the connection is parsed with exactly its own body, however many reads
        that body takes, and whatever follows it is ignored (RFC 9112 section 9.6)."""
        if data:
            self._heard = True
        if self.tunnel is not None:
            # Straight to the tunnel, also once a drain has begun (aiohttp then drops what a
            # connection sends: its requests are over, a tunnel is not).
            self.tunnel.feed_data(data)
            return
        if self._upgraded or self._payload_parser is not None:
            super().data_received(data)  # not HTTP any more: the tunnel's bytes
            return
        if not data:
            # aiohttp's resume_reading: the parser goes on with bytes it kept when its body
            # reader was full; then the bytes held here while it was full follow.
            self._feed(b"")
            self._check_body_end()
            data, self._held = self._held, b""
            if not data:
                return
        elif self._held:
            self._held += data
            return
        framing = self._framing
        while data:
            if self.draining and not framing.in_body:
                return  # a drain: the body of the request in flight still comes in, no new one
            if self._reading_paused and not framing.passthrough:
                # The parser keeps the rest of its last input until the body reader has
                # room: what it made of it is not known yet, so nothing more is cut now.
                self._held = data
                return
            n = framing.take(data)
            if n == 0:
                return  # after a request that closes the connection: ignored
            piece, data = data[:n], data[n:]
            before = len(self._messages)
            if framing.in_request_line:
                at_start = not self._line
                parsed, self._line, framing.line_done = escape_request_line(piece, self._line)
                if at_start:
                    # A method the parser does not know, stood in for (proxy/methods.py).
                    blank = len(parsed) - len(parsed.lstrip(b"\r\n"))
                    line, self._method = stand_in(parsed[blank:])
                    parsed = parsed[:blank] + line
                self._feed(parsed)
            else:
                self._feed(piece)
            framing.fed(piece)
            for i in range(before, len(self._messages)):
                msg = self._messages[i][0]
                line, self._line = self._line, b""
                method, self._method = self._method, None
                if isinstance(msg, RawRequestMessage):
                    if method is not None:
                        msg = msg._replace(method=method)
                        self._messages[i] = (msg, self._messages[i][1])
                    target = None if line.isascii() else target_of(line)
                    if target is not None:
                        # The parser saw its bytes over 0x7F escaped: the target goes on
                        # exactly as the client sent it (as nginx and gunicorn do).
                        self._messages[i] = (
                            msg._replace(path=target.decode("latin-1")),
                            self._messages[i][1],
                        )
                    self._chunked_open = msg.chunked
                    value = msg.headers.get("Content-Length")
                    framing.head(
                        int(value) if value is not None and value.isdigit() else 0,
                        msg.chunked,
                        msg.should_close,
                        _parser_switches(msg),
                    )
                else:
                    framing.refused()
            self._check_body_end()

    def _check_body_end(self) -> None:
        """Tell the framing when the parser ended a chunked body (its reader is at EOF)."""
        last = self._last_payload
        if last is not None and self._chunked_open and last.is_eof():
            self._chunked_open = False
            self._framing.body_ended()

    def _feed(self, data: bytes) -> None:
        # Only bytes that start a new head arm the timer: the body of a request already
        # answered early (413, breaker-open...) still arriving on a kept-alive connection must
        # not, or an idle connection gets an unsolicited 408 that the client's next request
        # reads as its answer.
        last = self._last_payload
        starts_head = (
            bool(data)
            and not self.in_request
            and self._head_timer is None
            and (last is None or last.is_eof())
        )
        before = len(self._messages)
        if self.draining and self._framing.in_body:
            # aiohttp reads nothing once a connection is closing, the body of the request in
            # flight included: that request would wait out the drain for bytes that never come.
            closing = self._close, self._force_close
            self._close = self._force_close = False
            try:
                super().data_received(data)
            finally:
                self._close, self._force_close = closing
        else:
            super().data_received(data)
        if len(self._messages) == before:
            if starts_head and not self._framing.closed and self.transport is not None:
                # The head is not complete in this read: it has header_timeout from now. (A
                # head that arrives whole, the common case, never costs a timer.)
                self._head_timer = self._loop.call_later(
                    self._guard.header_timeout(), self._head_timed_out
                )
        else:
            first = self._messages[before][0]
            if (
                self.in_request
                and last is not None
                and not last.is_eof()
                and isinstance(first, _ErrInfo)
            ):
                # Not a new request: the body the handler is reading is malformed (a chunk
                # size that is not hex). aiohttp queues it as a request to refuse but leaves
                # that body waiting for bytes that never come; fail the body instead, so its
                # reader answers 400 now rather than 408 when body_idle_timeout runs out.
                # (Once the handler has answered, aiohttp reads the rest of the body away
                # itself, and an error there would escape as a traceback: left to aiohttp,
                # which answers the queued 400.)
                del self._messages[before]
                last.set_exception(first.exc)
                return
            # A whole head was parsed (or rejected): the deadline is met.
            self.in_request = True
            self._cancel_head_timer()
            for i in range(before, len(self._messages)):
                msg, payload = self._messages[i]
                self._last_payload = payload
                if isinstance(msg, RawRequestMessage) and msg.version not in _VERSIONS:
                    # aiohttp accepts e.g. "HTTP/2.0" over HTTP/1.1 framing:
                    # refuse it before any handler sees it, answered as HTTP/1.x.
                    err = BadHttpMessage(f"unsupported HTTP version {msg.version}")
                    self._messages[i] = (_ErrInfo(400, err, err.message), payload)
                elif (
                    isinstance(msg, RawRequestMessage)
                    and msg.version == HttpVersion10
                    and "Transfer-Encoding" in msg.headers
                ):
                    # RFC 9112 section 6.1: Transfer-Encoding in an HTTP/1.0 message is
                    # faulty framing (an old intermediary may frame it by Content-Length or
                    # by the close): refused, and the connection closed (nginx: 400).
                    err = BadHttpMessage("Transfer-Encoding in an HTTP/1.0 request")
                    self._messages[i] = (_ErrInfo(400, err, err.message), payload)

    def request_done(self) -> None:
        """Called by the proxy handler when its response is finished."""
        self.in_request = False

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.in_request or self.transport is None:
            return
        transport = self.transport  # force_close() may drop self.transport
        if not self._heard:
            # Not a byte since accept (a pre-connect, an idle or hostile client): closed
            # without an answer nobody asked for, as nginx does; not a malformed request.
            self.force_close()
            transport.close()
            return
        self._guard.count("header-timeout")
        self._guard.warn("request head not complete within the header timeout; closing")
        answer = self._guard.refuse(408, "the request head took too long to arrive")
        transport.write(_error_bytes(answer, "Request Timeout"))
        self.force_close()
        transport.close()

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel_head_timer()
        self._cancel_send_timer()
        super().connection_lost(exc)

    # -- the send timeout -------------------------------------------------------------------

    def pause_writing(self) -> None:
        """The client's socket stopped taking bytes: it gets ``limits.send_timeout`` to take
        more, or the connection is cut; the cut cancels the handler (handler_cancellation),
        whose scopes give back the bulkhead slot, the upstream connection and the buffers."""
        super().pause_writing()
        if self._send_timer is None:
            self._send_timer = self._loop.call_later(
                self._guard.send_timeout(), self._send_timed_out
            )

    def resume_writing(self) -> None:
        self._cancel_send_timer()
        super().resume_writing()
        if self.tunnel is not None:
            self.tunnel.client_drained()

    def eof_received(self) -> bool | None:  # type: ignore[override]
        """A tunnel's client half-closed: it may still read what the upstream sends."""
        if self.tunnel is not None:
            self.tunnel.client_eof()
            return True
        return None

    def _send_timed_out(self) -> None:
        self._send_timer = None
        self._guard.count("send-timeout")
        self._guard.warn("a client took no response bytes within the send timeout; closing")
        if self.transport is not None:
            self.transport.abort()

    def _cancel_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    # -- malformed requests -----------------------------------------------------------------

    def _make_error_handler(
        self, err_info: _ErrInfo
    ) -> Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]:
        exc = err_info.exc
        too_large = isinstance(exc, LineTooLong) or (
            isinstance(exc, BadHttpMessage) and "Too many headers" in str(exc)
        )
        status = 431 if too_large else err_info.status
        reason = "header-too-large" if too_large else "malformed"
        if "unsupported HTTP version" in str(exc):
            reason = "http-version"
        self._guard.count(reason)
        self._guard.warn(f"refused a malformed request ({status}): {str(exc)[:200]}")

        async def handler(request: web.BaseRequest) -> web.StreamResponse:
            resp = self._guard.refuse(
                status,
                "request refused: "
                + ("request line or headers too large" if too_large else "malformed request"),
            )
            resp.force_close()
            return resp

        return handler


class SidecarServer(web.Server):
    """aiohttp's server with the guards above, for the proxy listener and the admin listener
    (``admin/listener.py``). ``refuse(status, message)`` makes the listener's own refusals
    (408, 400, 431): the proxy's carry ``Proxy-Status`` and ``x-retry-proxy-error``."""

    def __init__(
        self,
        handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]],
        header_timeout: Callable[[], float],
        on_malformed: Callable[[str], None],
        send_timeout: Callable[[], float] = lambda: 60.0,
        refuse: Callable[[int, str], web.Response] = client_error,
        **kwargs: Any,
    ) -> None:
        super().__init__(
            handler,
            max_line_size=MAX_LINE,
            max_field_size=MAX_FIELD,
            max_headers=MAX_HEADERS,
            **kwargs,
        )
        self.header_timeout = header_timeout
        self.send_timeout = send_timeout
        self.count = on_malformed
        self.refuse = refuse
        self._warn_limit = RateLimit(per_interval=10, interval=60.0)

    def warn(self, message: str) -> None:
        if self._warn_limit.allow():
            suppressed = self._warn_limit.suppressed
            log.warning(message + (f" ({suppressed} similar suppressed)" if suppressed else ""))

    def __call__(self) -> GuardedRequestHandler:
        return GuardedRequestHandler(self, loop=self._loop, **self._kwargs)

    def pre_shutdown(self) -> None:
        for conn in self.connections:
            if isinstance(conn, GuardedRequestHandler):
                conn.draining = True
        super().pre_shutdown()

    def cut(self) -> None:
        """The drain is over: every request still being handled is cancelled (its scopes give
        back what they hold). aiohttp's own shutdown waits its timeout for a request to end,
        then cancels only the request's body and waits the same time again: a handler waiting
        on the upstream or relaying a tunnel does not notice, and the process outlived its
        drain_timeout twice."""
        for conn in self.connections:
            task = conn._task_handler
            if task is not None and not task.done():
                task.cancel()

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
tests/test_hardening.py, which fail if either stops behaving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import StreamReader, web
from aiohttp.http import HttpVersion10, HttpVersion11, RawRequestMessage
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import MAX_MSG_QUEUE_SIZE, RequestHandler, _ErrInfo

from sidecar.proxy.methods import ends_at_boundary, stand_in, starts_request_line
from sidecar.proxy.respond import client_error
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.proxy")

MAX_LINE = 8190
MAX_FIELD = 8190
MAX_HEADERS = 100
_VERSIONS = (HttpVersion10, HttpVersion11)
# Requests queued at which aiohttp's parser pauses and keeps the rest of a read back.
_PARSER_QUEUE = MAX_MSG_QUEUE_SIZE


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


def _close_requested(head: bytes) -> bool:
    """Whether a request head (lower-cased) asks for the connection to close after it: a
    ``close`` option, or HTTP/1.0 without keep-alive. A cheap pre-check; the parser decides."""
    first, _, _ = head.partition(b"\r\n")
    if first.endswith(b"http/1.0"):
        return b"keep-alive" not in head
    return b"close" in head


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
        self._closing = False  # a request asked to close: later bytes are ignored
        self._peer = ""  # the client's address, read once per connection
        self.tunnel: TunnelEnd | None = None  # set while an upgraded connection is relayed
        self._at_boundary = True  # the parser is at the start of a request (proxy/methods.py)
        self._last_length_framed = False  # the last request's body has a Content-Length

    def peer(self) -> str:
        """The client's address. Kept for the connection's life: uvloop asks the kernel
        (getpeername) on every ``get_extra_info("peername")``, and every request needs it."""
        if not self._peer:
            self._peer = transport_peer(self.transport)
        return self._peer

    # -- the head deadline ------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.tunnel is not None:
            # Straight to the tunnel, also once a drain has begun (aiohttp then drops what a
            # connection sends: its requests are over, a tunnel is not).
            self.tunnel.feed_data(data)
            return
        if self._upgraded or self._payload_parser is not None:
            super().data_received(data)  # not HTTP any more: the tunnel's bytes
            return
        if self._closing:
            return  # RFC 9112 section 9.6: after a "close" request, further requests are not read
        end = data.find(b"\r\n\r\n")
        if 0 <= end < len(data) - 4 and _close_requested(data[:end].lower()):
            # A request asking to close, with bytes after its head in the same read (its body,
            # or pipelined requests): aiohttp's parser would refuse the whole read with 400.
            # Feed the head and the body it announces, and ignore the rest.
            before = len(self._messages)
            self._feed(data[: end + 4])
            msg = self._messages[-1][0] if len(self._messages) > before else None
            if isinstance(msg, RawRequestMessage) and msg.should_close and not msg.chunked:
                value = msg.headers.get("Content-Length")
                length = int(value) if value is not None and value.isdigit() else 0
                if length:
                    self._feed(data[end + 4 : end + 4 + length])
                self._closing = True
                return
            data = data[end + 4 :]
        while self._at_boundary:
            # Pipelined heads are fed one at a time while each leaves the parser at the next
            # request's start, so that a method it does not know is seen there too.
            end = data.find(b"\r\n\r\n")
            if end < 0 or not starts_request_line(data[end + 4 :]):
                break
            self._feed(data[: end + 4])
            data = data[end + 4 :]
        self._feed(data)

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
        was_boundary = self._at_boundary
        body_before = last.total_bytes if last is not None and not last.is_eof() else -1
        method: str | None = None
        if (
            self._at_boundary
            and len(self._messages) < _PARSER_QUEUE - 1  # so the parser keeps no tail back
            and self._payload_parser is None
        ):
            data, method = stand_in(data)  # a method the parser does not know
        self._at_boundary = False
        before = len(self._messages)
        super().data_received(data)
        if len(self._messages) == before:
            if starts_head and not self._closing and self.transport is not None:
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
            if method is not None and isinstance(first, RawRequestMessage):
                self._messages[before] = (first._replace(method=method), self._messages[before][1])
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
        if data or len(self._messages) != before:  # aiohttp feeds b"" to resume parsing
            self._at_boundary = self._ends_at_boundary(data, before, was_boundary, body_before)
        else:
            self._at_boundary = was_boundary

    def _ends_at_boundary(
        self, data: bytes, before: int, was_boundary: bool, body_before: int
    ) -> bool:
        """Whether the parser, fed ``data``, stopped exactly at the start of a request."""
        payload = self._last_payload
        pending = payload is not None and not payload.is_eof()
        new = len(self._messages) - before
        if new:
            msg = self._messages[-1][0]
            self._last_length_framed = (
                isinstance(msg, RawRequestMessage) and not msg.chunked and payload is not None
            )
            if new == 1 and was_boundary and self._last_length_framed and not pending:
                # One head and its whole Content-Length body: nothing may follow them.
                assert payload is not None
                return data.find(b"\r\n\r\n") + 4 + payload.total_bytes == len(data)
        elif body_before >= 0 and not pending and self._last_length_framed:
            assert payload is not None  # the rest of a Content-Length body, and nothing else?
            return payload.total_bytes - body_before == len(data)
        return ends_at_boundary(data, pending)

    def request_done(self) -> None:
        """Called by the proxy handler when its response is finished."""
        self.in_request = False

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.in_request or self.transport is None:
            return
        transport = self.transport  # force_close() may drop self.transport
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

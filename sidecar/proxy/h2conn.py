"""The HTTP/2 front end: one client connection driven by the ``h2`` package's state machine
(framing, HPACK, flow control: no framing code here), each stream made a ``ClientRequest`` and
run by the proxy handler in a task of its own, its answer written through an ``H2Sink``
(``proxy/h2sink.py``).

What it holds to account (the numbers in ``proxy/h2limits.py``; docs/http2.md): handler tasks
at most ``http2.max_concurrent_streams`` (counted as tasks, so a stream its client reset counts
until its task has unwound; one more is refused REFUSED_STREAM); a client's RST_STREAM cancels
its task at once, so its upstream attempt is cancelled as for an HTTP/1.1 client gone; the
header list bounded by the HPACK decoder; streams reset and control frames past their rates
end the connection with GOAWAY ENHANCE_YOUR_CALM; a socket that takes no bytes for
``limits.send_timeout`` is cut (its reading paused meanwhile), each stream's window likewise
(``H2Sink``); no stream for ``limits.keepalive_timeout`` closes it; ``drain`` sends GOAWAY and
closes once the streams are done, ``cut_all`` cancels the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import cast

from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    Event,
    PingReceived,
    PriorityUpdated,
    RemoteSettingsChanged,
    RequestReceived,
    StreamEnded,
    StreamReset,
    UnknownFrameReceived,
    WindowUpdated,
)
from h2.exceptions import DenialOfServiceError, FlowControlError, ProtocolError, StreamClosedError

from sidecar.proxy.frontend import ClientRequest, ResponseSink
from sidecar.proxy.h2fields import Malformed, RateBudget, RawFields, map_request
from sidecar.proxy.h2limits import (
    CONTROL_BURST,
    CONTROL_RATE,
    LINGER,
    RESET_BURST_MIN,
    RESET_RATE,
    H2Limits,
    goaway,
    server_connection,
)
from sidecar.proxy.h2sink import H2Body, H2Sink, H2Stream, send_pending
from sidecar.proxy.server import transport_peer
from sidecar.proxy.tlslisten import xfcc
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.proxy")

_CONTROL = (PingReceived, RemoteSettingsChanged, PriorityUpdated, UnknownFrameReceived)

Serve = Callable[[ClientRequest, ResponseSink], Awaitable[None]]


class H2Server(asyncio.Protocol):
    """One HTTP/2 client connection (see the module docstring)."""

    def __init__(
        self,
        serve: Serve,
        limits: H2Limits,
        *,
        count: Callable[[str], None],
        lost: Callable[[H2Server], None],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._serve = serve
        self.limits = limits
        self._count = count
        self._lost = lost
        self._clock = clock
        now = clock()
        self._resets = RateBudget(max(RESET_BURST_MIN, 2 * limits.streams), RESET_RATE, now)
        self._control = RateBudget(CONTROL_BURST, CONTROL_RATE, now)
        self.h2 = server_connection(limits)
        self.streams: dict[int, H2Stream] = {}
        self.transport: asyncio.Transport | None = None
        self.draining = False
        self._goaway_id: int | None = None
        self._paused = False
        self._writable: asyncio.Future[None] | None = None
        self._send_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._closed: asyncio.Future[None] | None = None
        self._attached: PriorityUpdated | None = None
        self._lingering = False
        self._peer = ""
        self._tls = False
        self._cert: bytes | None = None
        self._warn = RateLimit(per_interval=10, interval=60.0)

    # -- the connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        self._peer = transport_peer(transport)
        tls = transport.get_extra_info("ssl_object")
        self._tls = tls is not None
        if tls is not None:
            der = tls.getpeercert(binary_form=True)
            self._cert = xfcc(der) if der else None
        self._closed = asyncio.get_running_loop().create_future()
        self.h2.initiate_connection()
        self._write()
        # The first request is due within the head deadline, as an HTTP/1.1 connection's
        # first head is: a header block trickled in CONTINUATION frames holds no buffer past it.
        self._arm_idle(self.limits.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return  # closing: what still comes is read and dropped (``_close_now``)
        try:
            events = self.h2.receive_data(data)
        except DenialOfServiceError:
            self._count("header-too-large")
            self._close_now()
            return
        except (ProtocolError, FlowControlError) as exc:
            self._count("malformed")
            self._say(f"an HTTP/2 client broke the protocol; closing: {str(exc)[:200]}")
            self._close_now()
            return
        for event in events:
            if not self._event(event):
                return
        if self.h2.unpaid and not self._control_frame(self.h2.take_unpaid()):
            return  # frames on closed streams, WINDOW_UPDATEs no DATA paid for
        self._write()

    def _event(self, event: Event) -> bool:
        """Handle one event; False once the connection was closed for it."""
        if isinstance(event, RequestReceived):
            return self._request(event)
        if isinstance(event, DataReceived):
            return self._data(event)
        if isinstance(event, StreamEnded):
            stream = self.streams.get(event.stream_id or 0)
            if stream is not None:
                stream.body_ended = True
                stream.wake_body()
            return True
        if isinstance(event, StreamReset):
            return self._reset(event)
        if isinstance(event, WindowUpdated):
            if event.stream_id:
                self._flush_id(event.stream_id)
            else:
                self._flush_all()
            return True
        if isinstance(event, PriorityUpdated) and event is self._attached:
            return True  # a HEADERS frame's own priority: no frame of its own
        if isinstance(event, _CONTROL):
            if isinstance(event, RemoteSettingsChanged):
                self._flush_all()
            return self._control_frame()
        if isinstance(event, ConnectionTerminated):
            self.draining = True  # the client's GOAWAY: no new streams, finish these
            self._close_if_done()
        return True

    def _request(self, event: RequestReceived) -> bool:
        sid = event.stream_id or 0
        self._attached = event.priority_updated
        if self._goaway_id is not None and sid > self._goaway_id:
            self._refuse(sid, ErrorCodes.REFUSED_STREAM)
            return self._reset_taken()  # a stream we reset counts as one the client reset
        if len(self.streams) >= self.limits.streams:
            self._refuse(sid, ErrorCodes.REFUSED_STREAM)
            return self._reset_taken()
        mapped = map_request(event.headers or [])
        if isinstance(mapped, Malformed):
            self._count("malformed")
            self._say(f"refused a malformed HTTP/2 request: {mapped.reason}")
            self._refuse(sid, ErrorCodes.PROTOCOL_ERROR)
            return self._reset_taken()
        if mapped.connect:  # no tunnels over HTTP/2 (no extended CONNECT)
            self._refuse(sid, ErrorCodes.HTTP_1_1_REQUIRED)
            return self._reset_taken()
        ended = event.stream_ended is not None
        stream = H2Stream(self, sid, ended)
        request = ClientRequest(
            mapped.method,
            mapped.target,
            mapped.raw,
            mapped.fields,
            version=(2, 0),
            body=H2Body(stream),
            has_body=not ended,
            content_length=mapped.content_length,
            peer=self._peer,
            tls=self._tls,
            client_cert=self._cert,
        )
        self.streams[sid] = stream
        self._disarm_idle()
        stream.task = asyncio.get_running_loop().create_task(
            self._run(stream, request, H2Sink(stream, mapped.method))
        )
        return True

    def _data(self, event: DataReceived) -> bool:
        counted = event.flow_controlled_length or 0
        data = event.data or b""
        stream = self.streams.get(event.stream_id or 0)
        if stream is None or stream.cut:
            self._ack(event.stream_id or 0, counted)  # nobody reads it: the window back now
        else:
            if counted > len(data):  # padding: not the body's, given back at once
                self._ack(stream.id, counted - len(data))
            if data:
                stream.body.append((data, len(data)))
                stream.wake_body()
        if not data and event.stream_ended is None:
            return self._control_frame()  # empty DATA frames cost work and carry nothing
        return True

    def _reset(self, event: StreamReset) -> bool:
        stream = self.streams.get(event.stream_id or 0)
        if stream is not None:
            self._drop(stream)
        return self._reset_taken() if event.remote_reset else True

    def _reset_taken(self) -> bool:
        if self._resets.take(self._clock()):
            return True
        self._calm("streams reset faster than they can be served (rapid reset)")
        return False

    def _control_frame(self, n: int = 1) -> bool:
        if self._control.take(self._clock(), n):
            return True
        self._calm("control frames faster than allowed (SETTINGS, PING, PRIORITY... flood)")
        return False

    def _calm(self, why: str) -> None:
        self._count("http2-flood")
        self._say(f"an HTTP/2 client sent {why}; closing with ENHANCE_YOUR_CALM")
        self._goaway(ErrorCodes.ENHANCE_YOUR_CALM)
        self._close_now()

    # -- a stream's life ---------------------------------------------------------------------

    async def _run(self, stream: H2Stream, request: ClientRequest, sink: H2Sink) -> None:
        try:
            await self._serve(request, sink)
            if stream.end_queued and not stream.ended and not stream.cut:
                await self.drained(stream, 0)  # a whole answer still waiting for the window
        except ConnectionResetError:
            pass  # that wait ended with the stream reset
        except asyncio.CancelledError:
            pass  # its client reset it, or the drain is over: the handler has unwound
        finally:
            self._finish(stream)

    def _finish(self, stream: H2Stream) -> None:
        """The stream's task is over: its unread body given back, its stream closed."""
        if self.streams.pop(stream.id, None) is None:
            return
        unread = stream.unread()
        if unread:
            self._ack(stream.id, unread)
        if not stream.cut and not stream.ended:
            # The handler returned with the answer unfinished: never a truncated whole one.
            self._rst(stream.id, ErrorCodes.INTERNAL_ERROR)
        elif not stream.cut and not stream.body_ended:
            # Answered before the request's body ended: the rest is not wanted (RFC 9113
            # section 8.1).
            self._rst(stream.id, ErrorCodes.NO_ERROR)
        stream.cut = True
        self._write()
        if not self.streams:
            self._arm_idle()
        self._close_if_done()

    def _drop(self, stream: H2Stream) -> None:
        """The client reset ``stream`` (or the connection is gone): its task cancelled now."""
        stream.cut = True
        stream.pending.clear()
        stream.wake_body()
        stream.wake_out()
        task = stream.task
        if task is not None and not task.done():
            task.cancel()

    def cut(self, stream: H2Stream) -> None:
        """The answer cannot be completed (``H2Sink.abort``): the stream reset."""
        if not stream.cut:
            self._rst(stream.id, ErrorCodes.INTERNAL_ERROR)
            stream.cut = True
            stream.pending.clear()
            stream.wake_out()
            self._write()

    def consumed(self, stream: H2Stream, n: int) -> None:
        """``n`` bytes of ``stream``'s body were read: its window and the connection's open."""
        if not stream.cut:
            self._ack(stream.id, n)
            self._write()

    # -- sending -----------------------------------------------------------------------------

    def send_head(self, stream: H2Stream, fields: RawFields, end: bool) -> None:
        try:
            self.h2.send_headers(stream.id, fields, end_stream=end)
        except (StreamClosedError, ProtocolError):
            self._drop(stream)
            raise ConnectionResetError("the stream is closed") from None
        if end:
            stream.ended = True
        self._write()

    def flush(self, stream: H2Stream) -> None:
        self._flush_one(stream)
        self._write()

    def _flush_id(self, sid: int) -> None:
        stream = self.streams.get(sid)
        if stream is not None:
            self._flush_one(stream)

    def _flush_all(self) -> None:
        for stream in list(self.streams.values()):
            self._flush_one(stream)

    def _flush_one(self, stream: H2Stream) -> None:
        if not send_pending(self.h2, stream):
            self._drop(stream)

    async def drained(self, stream: H2Stream, high: int) -> None:
        """Until at most ``high`` bytes of ``stream``'s answer wait and the socket takes bytes;
        a stream stalled past the send timeout is reset and its writer told the client left."""
        try:
            async with asyncio.timeout(self.limits.send_timeout):
                while not stream.cut:
                    if len(stream.pending) > high or (high == 0 and not stream.ended):
                        waiter = stream.out_waiter = asyncio.get_running_loop().create_future()
                        try:
                            await waiter
                        finally:
                            stream.out_waiter = None
                    elif self._paused and self._writable is not None:
                        await asyncio.shield(self._writable)
                    else:
                        break
        except TimeoutError:
            self._count("send-timeout")
            self._say("an HTTP/2 stream took no answer bytes within the send timeout; reset")
            self._rst(stream.id, ErrorCodes.CANCEL)
            stream.cut = True
            stream.pending.clear()
            self._write()
        if stream.cut:
            raise ConnectionResetError("the client reset the stream")

    def _ack(self, sid: int, n: int) -> None:
        if n > 0:
            with contextlib.suppress(StreamClosedError, ProtocolError):
                self.h2.acknowledge_received_data(n, sid)

    def _rst(self, sid: int, code: ErrorCodes) -> None:
        with contextlib.suppress(StreamClosedError, ProtocolError):
            self.h2.reset_stream(sid, code)

    def _refuse(self, sid: int, code: ErrorCodes) -> None:
        self._rst(sid, code)
        self._write()

    def _goaway(self, code: ErrorCodes) -> None:
        """GOAWAY written as it is, outside ``h2``'s state machine (whose own GOAWAY closes the
        connection to every frame, the answers of the streams in flight included)."""
        self._write()
        self._goaway_id = last = self.h2.highest_inbound_stream_id
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(goaway(last, code))

    def _write(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _say(self, message: str) -> None:
        if self._warn.allow():
            log.warning("%s", message)

    # -- back-pressure, idleness, the end ----------------------------------------------------

    def pause_writing(self) -> None:
        self._paused = True
        self._writable = asyncio.get_running_loop().create_future()
        if self.transport is not None:
            self.transport.pause_reading()  # no more frames to answer while none go out
        self._send_timer = asyncio.get_running_loop().call_later(
            self.limits.send_timeout, self._send_timed_out
        )

    def resume_writing(self) -> None:
        self._paused = False
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def _send_timed_out(self) -> None:
        self._send_timer = None
        self._count("send-timeout")
        self._say("an HTTP/2 client took no bytes within the send timeout; closing")
        if self.transport is not None:
            self.transport.abort()

    def _arm_idle(self, after: float | None = None) -> None:
        self._disarm_idle()
        if self.transport is not None:
            self._idle_timer = asyncio.get_running_loop().call_later(
                self.limits.idle if after is None else after, self._idle_out
            )

    def _disarm_idle(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_out(self) -> None:
        self._idle_timer = None
        if not self.streams:
            self._goaway(ErrorCodes.NO_ERROR)
            self._close_now()

    def drain(self) -> None:
        """The listener is shutting down: GOAWAY, and close once the streams are done."""
        if not self.draining:
            self.draining = True
            self._goaway(ErrorCodes.NO_ERROR)
        self._close_if_done()

    def cut_all(self) -> None:
        """The drain is over: every stream still running is cancelled."""
        for stream in list(self.streams.values()):
            self._drop(stream)

    async def wait_closed(self, timeout: float | None) -> None:
        if self._closed is not None:
            await asyncio.wait({self._closed}, timeout=timeout)

    def _close_if_done(self) -> None:
        if self.draining and not self.streams and self.transport is not None:
            self._write()
            self.transport.close()

    def _close_now(self) -> None:
        """Every stream cancelled; the GOAWAY sent, then our side shut and what the client
        still sends read and dropped for ``LINGER`` seconds before the socket goes (a close
        with unread bytes would send a reset that may overtake the GOAWAY, as nginx's
        lingering close avoids)."""
        self._write()
        for stream in list(self.streams.values()):
            self._drop(stream)
        transport = self.transport
        if transport is None or self._lingering:
            return
        self._lingering = True
        self._disarm_idle()
        if transport.can_write_eof():
            transport.write_eof()
            asyncio.get_running_loop().call_later(LINGER, transport.abort)
        else:
            transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._send_timer, self._idle_timer):
            if timer is not None:
                timer.cancel()
        self._send_timer = self._idle_timer = None
        for stream in list(self.streams.values()):
            self._drop(stream)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self.transport = None
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        self._lost(self)

"""The HTTP/2 front end: one client connection driven by the ``h2`` package's state machine
(framing, HPACK, flow control: no framing code here), each stream made a ``ClientRequest`` and
run by the proxy handler in a task of its own, its answer written through an ``H2Sink``
(``proxy/h2sink.py``).

What the connection holds to account (see docs/http2.md):

- streams: at most ``http2.max_concurrent_streams`` handler tasks at once, advertised in
  SETTINGS; one more is refused with RST_STREAM REFUSED_STREAM (not processed: safe to retry).
  The count is of tasks, not of ``h2``'s open streams: a stream the client reset counts until
  its task has unwound, so resetting streams never buys room for more work;
- a client's RST_STREAM cancels its task at once (within the loop turn), which cancels its
  upstream attempt as for an HTTP/1.1 client gone;
- the header list: ``limits.max_header_bytes`` advertised as SETTINGS_MAX_HEADER_LIST_SIZE and
  enforced by the HPACK decoder (an HPACK bomb ends the connection: COMPRESSION state cannot be
  kept past a refused block); ``h2`` ends a header block after 64 CONTINUATION frames;
- rates: streams reset (by the client, or refused) past ``RESET_BURST`` at ``RESET_RATE`` a
  second (rapid reset, CVE-2023-44487), and SETTINGS, PING, PRIORITY, unknown and empty DATA
  frames past ``CONTROL_BURST`` at ``CONTROL_RATE`` a second, end the connection with GOAWAY
  ENHANCE_YOUR_CALM;
- writes: a socket that takes no bytes for ``limits.send_timeout`` is cut (its reading paused
  meanwhile, so answers to a flood cannot pile up), and each stream's window likewise
  (``H2Sink``); a connection with no stream for ``limits.keepalive_timeout`` is closed;
- the drain: ``drain`` sends GOAWAY (NO_ERROR, the last stream id seen), refuses streams opened
  after it, and the connection closes once its streams are done; ``cut`` cancels the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final, cast

from h2.config import H2Configuration
from h2.connection import H2Connection
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
from h2.settings import SettingCodes, Settings
from hyperframe.frame import GoAwayFrame

from sidecar.proxy.frontend import ClientRequest, ResponseSink
from sidecar.proxy.h2fields import Malformed, RateBudget, RawFields, map_request
from sidecar.proxy.h2sink import H2Body, H2Sink, H2Stream
from sidecar.proxy.server import transport_peer
from sidecar.proxy.tlslisten import xfcc
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.proxy")

RESET_BURST_MIN = 200  # streams reset at once before the rate applies (or 2x the stream limit)
RESET_RATE = 100.0  # streams reset a second, sustained
CONTROL_BURST = 200  # SETTINGS / PING / PRIORITY / unknown / empty DATA frames at once
CONTROL_RATE = 100.0  # a second, sustained
LINGER = 2.0  # seconds a connection closed for an error reads and drops what still comes
_NO_LIMIT = 2**31  # h2's own stream check (a connection error) kept out of the way

_CONTROL = (PingReceived, RemoteSettingsChanged, PriorityUpdated, UnknownFrameReceived)

Serve = Callable[[ClientRequest, ResponseSink], Awaitable[None]]


class H2Limits:
    """What a connection is held to, read from the config when it is accepted."""

    __slots__ = ("header_bytes", "idle", "send_timeout", "streams")

    def __init__(self, streams: int, header_bytes: int, send_timeout: float, idle: float) -> None:
        self.streams: Final = streams
        self.header_bytes: Final = header_bytes
        self.send_timeout: Final = send_timeout
        self.idle: Final = idle


class _LocalSettings(Settings):
    """Our settings as advertised; ``h2``'s own check of the stream limit (a connection error
    PROTOCOL_ERROR) never fires: the connection refuses a stream over it with REFUSED_STREAM."""

    @property
    def max_concurrent_streams(self) -> int:
        return _NO_LIMIT

    @max_concurrent_streams.setter
    def max_concurrent_streams(self, value: int) -> None:
        self[SettingCodes.MAX_CONCURRENT_STREAMS] = value


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
        config = H2Configuration(
            client_side=False, header_encoding=None, validate_inbound_headers=False
        )
        self.h2 = conn = H2Connection(config)
        conn.local_settings = _LocalSettings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: limits.streams,
                SettingCodes.MAX_HEADER_LIST_SIZE: limits.header_bytes,
                SettingCodes.ENABLE_PUSH: 0,
            },
        )
        conn.decoder.max_header_list_size = limits.header_bytes
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
        self._arm_idle()

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
            return True
        if len(self.streams) >= self.limits.streams:
            self._refuse(sid, ErrorCodes.REFUSED_STREAM)
            return self._reset_taken()
        mapped = map_request(event.headers or [])
        if isinstance(mapped, Malformed):
            self._count("malformed")
            self._say(f"refused a malformed HTTP/2 request: {mapped.reason}")
            self._refuse(sid, ErrorCodes.PROTOCOL_ERROR)
            return True
        if mapped.connect:  # no tunnels over HTTP/2 (no extended CONNECT)
            self._refuse(sid, ErrorCodes.HTTP_1_1_REQUIRED)
            return True
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
        if stream is None or stream.reset:
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

    def _control_frame(self) -> bool:
        if self._control.take(self._clock()):
            return True
        self._calm("control frames faster than allowed (SETTINGS, PING, PRIORITY flood)")
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
            if stream.end_queued and not stream.ended and not stream.reset:
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
        if not stream.reset and not stream.ended:
            # The handler returned with the answer unfinished: never a truncated whole one.
            self._rst(stream.id, ErrorCodes.INTERNAL_ERROR)
        elif not stream.reset and not stream.body_ended:
            # Answered before the request's body ended: the rest is not wanted (RFC 9113
            # section 8.1).
            self._rst(stream.id, ErrorCodes.NO_ERROR)
        stream.reset = True
        self._write()
        if not self.streams:
            self._arm_idle()
        self._close_if_done()

    def _drop(self, stream: H2Stream) -> None:
        """The client reset ``stream`` (or the connection is gone): its task cancelled now."""
        stream.reset = True
        stream.pending.clear()
        stream.wake_body()
        stream.wake_out()
        task = stream.task
        if task is not None and not task.done():
            task.cancel()

    def cut(self, stream: H2Stream) -> None:
        """The answer cannot be completed (``H2Sink.abort``): the stream reset."""
        if not stream.reset:
            self._rst(stream.id, ErrorCodes.INTERNAL_ERROR)
            stream.reset = True
            stream.pending.clear()
            stream.wake_out()
            self._write()

    def consumed(self, stream: H2Stream, n: int) -> None:
        """``n`` bytes of ``stream``'s body were read: its window and the connection's open."""
        if not stream.reset:
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
        """Send what the peer's windows allow of ``stream``'s answer, and its end once all is
        sent."""
        if stream.reset or stream.ended:
            return
        conn = self.h2
        try:
            while stream.pending:
                room = min(conn.local_flow_control_window(stream.id), conn.max_outbound_frame_size)
                if room <= 0:
                    break
                chunk = bytes(stream.pending[:room])
                del stream.pending[:room]
                conn.send_data(stream.id, chunk)
            if not stream.pending and stream.end_queued:
                if stream.trailers:
                    conn.send_headers(stream.id, stream.trailers, end_stream=True)
                else:
                    conn.end_stream(stream.id)
                stream.ended = True
        except (StreamClosedError, ProtocolError):
            self._drop(stream)
        if not stream.pending:
            stream.wake_out()

    async def drained(self, stream: H2Stream, high: int) -> None:
        """Until at most ``high`` bytes of ``stream``'s answer wait and the socket takes bytes;
        a stream stalled past the send timeout is reset and its writer told the client left."""
        try:
            async with asyncio.timeout(self.limits.send_timeout):
                while not stream.reset:
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
            stream.reset = True
            stream.pending.clear()
            self._write()
        if stream.reset:
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
        last = self.h2.highest_inbound_stream_id
        self._goaway_id = last
        frame = GoAwayFrame(0)
        frame.last_stream_id = last
        frame.error_code = code
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(frame.serialize())

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

    def _arm_idle(self) -> None:
        self._disarm_idle()
        if self.transport is not None:
            self._idle_timer = asyncio.get_running_loop().call_later(
                self.limits.idle, self._idle_out
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

"""One HTTP/2 connection to an upstream, driven by the ``h2`` state machine: its streams' events,
its flow-control windows, its idle close and GOAWAY (``h2pool`` tells the story).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any, cast

from h2.config import H2Configuration
from h2.connection import ConnectionState, H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    InformationalResponseReceived,
    RemoteSettingsChanged,
    ResponseReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowUpdated,
)
from h2.exceptions import H2Error, StreamClosedError
from h2.settings import SettingCodes, Settings

from sidecar import h2quiet, outcomes
from sidecar.core import (
    BadResponse,
    ConnectFailure,
    UpstreamReset,
)
from sidecar.upstream.h2stream import H2Exchange, Headers, expire, grpc_status_of
from sidecar.upstream.responsehead import MAX_INTERIM, MAX_RESPONSE_HEAD, check_final_status

h2quiet.quiet()  # h2 and hpack without their per-frame debug work

STREAM_WINDOW = 256 * 1024  # per stream: what one response may have buffered unread
CONNECTION_WINDOW = 16 * 1024 * 1024  # per connection, across its streams
WRITE_HIGH = 256 * 1024  # transport buffer above which a body sender waits


class _Connection(H2Connection):
    """``h2``'s client connection, but one that goes on after a GOAWAY: ``h2`` closes its
    state machine at once, and the next frame (the answer to a stream at or below the
    GOAWAY's last id, which RFC 9113 section 6.8 says the upstream may still complete) would
    end the connection and fail every such stream -- a graceful shutdown of the upstream
    made a retry of calls it was finishing. The link opens no stream after a GOAWAY."""

    def _receive_goaway_frame(self, frame: Any) -> Any:
        before = self.state_machine.state
        out = super()._receive_goaway_frame(frame)
        if before is not ConnectionState.CLOSED:
            self.state_machine.state = before
        return out


class H2Link(asyncio.Protocol):
    """One HTTP/2 connection to an upstream."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        idle_timeout: float,
        lost: Callable[[H2Link], None],
    ) -> None:
        self.loop = loop
        self.idle_timeout = idle_timeout
        self._lost = lost  # the pool's: this link takes no more streams
        config = H2Configuration(client_side=True, header_encoding=None)
        self.h2 = _Connection(config=config)
        # Our settings as the first SETTINGS frame says them (assigning the attributes of
        # ``local_settings`` would only queue them): each stream's receive window, the
        # response head's bound, no push, no stream from the upstream.
        self.h2.local_settings = Settings(
            client=True,
            initial_values={
                SettingCodes.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
                SettingCodes.MAX_HEADER_LIST_SIZE: MAX_RESPONSE_HEAD,
                SettingCodes.ENABLE_PUSH: 0,
                SettingCodes.MAX_CONCURRENT_STREAMS: 0,
            },
        )
        self.h2.decoder.max_header_list_size = MAX_RESPONSE_HEAD
        self.h2.max_inbound_frame_size = self.h2.local_settings.max_frame_size
        self.streams: dict[int, H2Exchange] = {}
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.goaway = False
        self.alpn: str | None = None
        self._writable: asyncio.Future[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._window_waiters: set[asyncio.Future[bool]] = set()
        # Set when the upstream's first SETTINGS came (its stream limit known): no stream is
        # opened before, so a limit of 1 is not overrun by a burst.
        self.ready: asyncio.Future[None] = loop.create_future()

    # -- the connection ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)
        sslobj = transport.get_extra_info("ssl_object")
        if sslobj is not None:
            self.alpn = sslobj.selected_alpn_protocol()
        self.transport.set_write_buffer_limits(high=WRITE_HIGH)
        h2 = self.h2
        h2.initiate_connection()
        h2.increment_flow_control_window(CONNECTION_WINDOW - 65535)
        self._flush()
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.ready.done():
            self.ready.set_exception(ConnectionResetError("closed before its SETTINGS"))
            self.ready.exception()  # retrieved: nobody may wait for it
        self.closed = True
        self._lost(self)
        if self._idle is not None:
            self._idle.cancel()
        for ex in list(self.streams.values()):
            ex.fail(UpstreamReset(f"upstream closed the HTTP/2 connection: {exc or 'EOF'}"))
        w = self._writable
        if w is not None and not w.done():
            w.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = self.loop.create_future()

    def resume_writing(self) -> None:
        w = self._writable
        if w is not None and not w.done():
            w.set_result(None)

    def usable(self) -> bool:
        return not self.closed and not self.goaway and self.transport is not None

    def has_room(self) -> bool:
        h2 = self.h2
        return (
            self.usable() and h2.open_outbound_streams < h2.remote_settings.max_concurrent_streams
        )

    def refuses_streams(self) -> bool:
        """Open, and its upstream allows no stream at all (it says it is overloaded)."""
        return self.usable() and self.h2.remote_settings.max_concurrent_streams == 0

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            with contextlib.suppress(H2Error):
                self.h2.close_connection()
                self._flush()
            self.transport.close()

    def _flush(self) -> None:
        data = self.h2.data_to_send()
        if data and self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def _arm_idle(self) -> None:
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if not self.streams and not self.closed:
            self._idle = self.loop.call_later(self.idle_timeout, self._idle_out)

    def _idle_out(self) -> None:
        self._idle = None
        if not self.streams:
            self.close()

    # -- streams -----------------------------------------------------------------------------

    def open(self, fields: Headers, end: bool, head_only: bool, grpc: bool) -> H2Exchange:
        h2 = self.h2
        sid = h2.get_next_available_stream_id()
        ex = H2Exchange(self, sid, head_only, grpc)
        self.streams[sid] = ex
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        h2.send_headers(sid, fields, end_stream=end)
        self._flush()
        return ex

    def forget(self, ex: H2Exchange) -> None:
        self.streams.pop(ex.id, None)
        if self.goaway and not self.streams:
            self.close()
        else:
            self._arm_idle()

    def reset(self, ex: H2Exchange) -> None:
        if self.closed:
            return
        with contextlib.suppress(H2Error):
            if not (ex.ended and not ex.sender_running() and self._local_closed(ex.id)):
                self.h2.reset_stream(ex.id, ErrorCodes.CANCEL)
                self._flush()

    def _local_closed(self, sid: int) -> bool:
        stream = self.h2.streams.get(sid)
        return stream is None or stream.closed

    def consumed(self, ex: H2Exchange, n: int) -> None:
        if n and not self.closed and not ex.done:
            with contextlib.suppress(H2Error):
                self.h2.acknowledge_received_data(n, ex.id)
                self._flush()

    async def send_body(self, ex: H2Exchange, data: bytes, end: bool, idle: float) -> bool:
        """Send ``data`` within the windows (waiting for them at most ``idle`` each time);
        False when the upstream answered (or the stream ended) before it was all sent."""
        h2 = self.h2
        view = memoryview(data)
        while view:
            if ex.ended or ex.error is not None or self.closed:
                return False
            try:
                window = min(h2.local_flow_control_window(ex.id), h2.max_outbound_frame_size)
            except (StreamClosedError, H2Error):
                return False
            if window <= 0:
                if not await self._window(idle):
                    raise UpstreamReset(f"the upstream took no request body for {idle:g}s")
                continue
            chunk, view = view[:window], view[window:]
            h2.send_data(ex.id, bytes(chunk), end_stream=end and not view)
            self._flush()
            w = self._writable
            if w is not None and not w.done():
                await asyncio.wait_for(asyncio.shield(w), idle)
        if end and not data:
            h2.end_stream(ex.id)
            self._flush()
        return True

    async def _window(self, idle: float) -> bool:
        """Wait for a WINDOW_UPDATE at most ``idle``; False when none came."""
        w: asyncio.Future[bool] = self.loop.create_future()
        self._window_waiters.add(w)
        handle = self.loop.call_later(idle, expire, w)
        try:
            return await w
        finally:
            handle.cancel()
            self._window_waiters.discard(w)

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except H2Error as exc:
            err = UpstreamReset(f"the upstream broke HTTP/2: {exc!r}")
            for ex in list(self.streams.values()):
                ex.fail(err)
            self._flush()
            self.close()
            return
        for ev in events:
            self._event(ev)
        self._flush()

    def _event(self, ev: object) -> None:
        if isinstance(ev, DataReceived):
            ex = self.streams.get(ev.stream_id)
            if ex is None:
                with contextlib.suppress(H2Error):
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                return
            if ev.data:
                ex.body.append(ev.data)
                ex.buffered += len(ev.data)
            padding = ev.flow_controlled_length - len(ev.data)
            if padding:
                self.consumed(ex, padding)
            ex.data_seen = True
            ex.wake()
        elif isinstance(ev, ResponseReceived):
            ex = self.streams.get(ev.stream_id)
            if ex is not None:
                self._head(ex, ev.headers)
        elif isinstance(ev, InformationalResponseReceived):
            ex = self.streams.get(ev.stream_id)
            if ex is not None:
                status = int(dict(ev.headers).get(b":status", b"100"))
                if status != 100:
                    if len(ex.interim) >= MAX_INTERIM:
                        ex.fail(BadResponse("too many 1xx responses", "http_protocol_error"))
                        return
                    ex.interim.append((status, [(k, v) for k, v in ev.headers if k[:1] != b":"]))
        elif isinstance(ev, TrailersReceived):
            ex = self.streams.get(ev.stream_id)
            if ex is not None:
                ex.trailers = list(ev.headers)
                if ex.grpc and not ex.data_seen:
                    ex.grpc_status, ex.pushback = grpc_status_of(ex.trailers)
        elif isinstance(ev, StreamEnded):
            ex = self.streams.get(ev.stream_id)
            if ex is not None:
                ex.ended = True
                ex.wake()
        elif isinstance(ev, StreamReset):
            ex = self.streams.get(ev.stream_id)
            if ex is not None:
                if ev.error_code == ErrorCodes.REFUSED_STREAM and not ex.has_head:
                    ex.fail(
                        ConnectFailure(
                            "the upstream refused the stream (not processed)", "connection_refused"
                        )
                    )
                elif ex.has_head and ex.ended:
                    pass
                elif ex.has_head and ev.error_code == ErrorCodes.NO_ERROR:
                    ex.abandoned = True  # answered: it wants no more of the request
                    ex.wake()
                else:
                    ex.fail(
                        UpstreamReset(f"the upstream reset the stream ({ev.error_code!r})"),
                        int(ev.error_code),
                    )
        elif isinstance(ev, ConnectionTerminated):
            self.goaway = True
            last = ev.last_stream_id if ev.last_stream_id is not None else 0
            for sid, ex in list(self.streams.items()):
                if sid > last:
                    ex.fail(
                        ConnectFailure(
                            "the upstream went away before the stream (not processed)",
                            "connection_refused",
                        )
                    )
            self._lost(self)
        elif isinstance(ev, RemoteSettingsChanged):
            if not self.ready.done():
                self.ready.set_result(None)
        elif isinstance(ev, WindowUpdated):
            for w in list(self._window_waiters):
                if not w.done():
                    w.set_result(True)

    def _head(self, ex: H2Exchange, raw: Headers) -> None:
        status_b = b""
        fields: Headers = []
        for k, v in raw:
            if k[:1] == b":":
                if k == b":status":
                    status_b = v
                continue
            fields.append((k, v))
        status = int(status_b) if status_b.isdigit() else 0
        try:
            check_final_status(status)
        except BadResponse as exc:
            ex.fail(exc)
            return
        ex.headers = fields
        ex.status = status
        if ex.grpc:
            if status == 200:
                ex.grpc_status, ex.pushback = grpc_status_of(fields)
            else:  # as a gRPC client reads an HTTP status (503 is UNAVAILABLE)
                ex.grpc_status = outcomes.GRPC_OF_HTTP.get(status, outcomes.GRPC_UNKNOWN)
        ex.wake()

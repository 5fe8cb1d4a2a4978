"""One HTTP/2 stream as the request path sees it: its request body (``H2Body``, a
``frontend.RequestBody`` fed by DATA frames) and its answer (``H2Sink``, a ``ResponseSink``:
HEADERS, DATA within the peer's flow-control window, trailers, END_STREAM; ``gone`` once the
client reset the stream or the connection was lost).

Flow control bounds what is buffered both ways. A request body's DATA is acknowledged (its
window opened again) only as the path reads it, so a slow upstream holds at most the stream's
initial window (65,535 bytes) per stream and the connection's window per connection. An answer's
body waits in ``pending`` for the peer's window; ``write`` returns once at most ``OUT_HIGH``
bytes are left (``end`` once all are sent), and a stream whose window stays shut for
``limits.send_timeout`` is reset (CANCEL) and its writer told the client is gone, as an HTTP/1.1
client that takes no bytes is cut. The connection (``proxy/h2conn.py``) does the sending.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Final, Protocol

from aiohttp.helpers import must_be_empty_body
from h2.connection import H2Connection
from h2.exceptions import ProtocolError, StreamClosedError

from sidecar.proxy.body import ClientGone
from sidecar.proxy.frontend import Head, RawHeaders
from sidecar.proxy.h2fields import response_fields, trailer_fields

OUT_HIGH = 64 * 1024  # answer bytes a writer may leave waiting for the peer's window
WHOLE_LIMIT = 64 * 1024  # complete upstream bodies up to this are given whole


class StreamOwner(Protocol):
    """What a stream asks of its connection (``h2conn.H2Server``)."""

    def consumed(self, stream: H2Stream, n: int) -> None: ...

    def send_head(self, stream: H2Stream, fields: RawHeaders, end: bool) -> None: ...

    def flush(self, stream: H2Stream) -> None: ...

    async def drained(self, stream: H2Stream, high: int) -> None: ...

    def cut(self, stream: H2Stream) -> None: ...


class H2Stream:
    """The state of one stream the connection serves (owned by ``H2Server``)."""

    __slots__ = (
        "body",
        "body_ended",
        "body_waiter",
        "conn",
        "cut",
        "end_queued",
        "ended",
        "id",
        "out_waiter",
        "pending",
        "task",
        "trailers",
    )

    def __init__(self, conn: StreamOwner, stream_id: int, body_ended: bool) -> None:
        self.conn: Final = conn
        self.id: Final = stream_id
        self.body: deque[tuple[bytes, int]] = deque()  # (data, flow-controlled length)
        self.body_ended = body_ended  # the client's END_STREAM came
        self.body_waiter: asyncio.Future[None] | None = None
        self.pending = bytearray()  # answer bytes waiting for the peer's window
        self.end_queued = False  # END_STREAM (or trailers) goes once ``pending`` is sent
        self.trailers: RawHeaders | None = None
        self.ended = False  # our side of the stream is closed
        self.out_waiter: asyncio.Future[None] | None = None
        self.cut = False  # the client reset the stream, or the connection is gone
        self.task: asyncio.Task[None] | None = None

    def wake_body(self) -> None:
        waiter = self.body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def wake_out(self) -> None:
        waiter = self.out_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def unread(self) -> int:
        """Flow-controlled bytes received and not read: given back to the connection's window
        when the stream ends unread."""
        total = sum(n for _, n in self.body)
        self.body.clear()
        return total


def send_pending(conn: H2Connection, stream: H2Stream) -> bool:
    """Send what the peer's windows allow of ``stream``'s answer, and its end (trailers or
    END_STREAM) once all of it is sent. False: the stream turned out closed (reset)."""
    if stream.cut or stream.ended:
        return True
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
        return False
    if not stream.pending:
        stream.wake_out()
    return True


class H2Body:
    """A stream's request body, read as DATA frames came (see the module docstring)."""

    __slots__ = ("_stream",)

    def __init__(self, stream: H2Stream) -> None:
        self._stream = stream

    async def read(self, n: int) -> bytes:
        stream = self._stream
        while not stream.body:
            if stream.cut:
                raise ClientGone("the client reset its stream during its upload")
            if stream.body_ended:
                return b""
            waiter = stream.body_waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                stream.body_waiter = None
        data, counted = stream.body[0]
        if len(data) > n:
            stream.body[0] = (data[n:], counted - n)
            data, counted = data[:n], n
        else:
            stream.body.popleft()
        stream.conn.consumed(stream, counted)
        return data


class H2Sink:
    """The answer to one HTTP/2 stream (see the module docstring)."""

    __slots__ = ("_empty", "_method", "_sent", "_stream")

    def __init__(self, stream: H2Stream, method: str) -> None:
        self._stream = stream
        self._method = method
        self._empty = False
        self._sent = 0

    @property
    def whole_limit(self) -> int:
        return WHOLE_LIMIT

    @property
    def sent(self) -> int:
        return self._sent

    def gone(self) -> bool:
        return self._stream.cut

    def _check(self) -> H2Stream:
        stream = self._stream
        if stream.cut or stream.ended:
            raise ConnectionResetError("the client reset the stream")
        return stream

    async def interim(self, status: int, fields: RawHeaders) -> None:
        # HTTP/2 has no 101 (RFC 9113 section 8.6); other 1xx go as HEADERS.
        if status != 101:
            self._stream.conn.send_head(self._check(), response_fields(status, fields, []), False)

    def _start(self, head: Head, has_body: bool) -> None:
        stream = self._check()
        self._empty = empty = must_be_empty_body(self._method, head.status)
        fields = response_fields(head.status, head.fields, head.own)
        stream.conn.send_head(stream, fields, empty or not has_body)

    def whole(self, head: Head, body: bytes) -> None:
        self._start(head, bool(body))
        if not self._empty and body:
            stream = self._stream
            stream.pending += body
            stream.end_queued = True
            self._sent = len(body)
            stream.conn.flush(stream)

    async def start(self, head: Head) -> None:
        self._start(head, True)

    async def write(self, chunk: bytes) -> None:
        if self._empty or not chunk:
            return
        stream = self._check()
        stream.pending += chunk
        self._sent += len(chunk)
        stream.conn.flush(stream)
        await stream.conn.drained(stream, OUT_HIGH)

    async def end(self, trailers: RawHeaders | None = None) -> None:
        stream = self._stream
        if self._empty or stream.ended:
            return
        self._check()
        stream.trailers = trailer_fields(trailers) if trailers else None
        stream.end_queued = True
        stream.conn.flush(stream)
        await stream.conn.drained(stream, 0)

    def abort(self) -> None:
        """The answer is cut: the stream reset (INTERNAL_ERROR), never a truncated whole."""
        self._stream.conn.cut(self._stream)

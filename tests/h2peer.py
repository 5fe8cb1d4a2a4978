"""A scriptable HTTP/2 upstream (h2c with prior knowledge) on loopback, on the ``h2`` package, for
the HTTP/2 upstream tests: what an h2 server may do that nginx will not do on demand (refuse a
stream, send GOAWAY under a stream, answer with trailers, hold a stream open, send more than a
window), and what it saw (each stream's fields, the resets it got, its connections).

Paths:

- ``/echo``: 200, the request's fields as JSON (``[[name, value], ...]``) and its body length.
- ``/refuse-once``: the first stream of the path is reset ``REFUSED_STREAM``; later ones as echo.
- ``/goaway-once``: the first stream of the path gets ``GOAWAY`` with a last stream id below it
  (not processed), then the connection closes; later ones as echo.
- ``/trailers``: 200, a body, then trailers ``x-checksum: 1``.
- ``/hold``: headers and one DATA frame, then nothing: the stream stays open until reset.
- ``/big?n=BYTES``: 200 with that many bytes, sent as the client's windows allow.
- ``/status?code=N``: that status, empty body.
- ``/goaway-then-answer``: GOAWAY NO_ERROR with this stream as the last id (a graceful
  shutdown), then the answer (a gRPC OK) -- written as raw frames, since ``h2`` sends nothing
  after its own GOAWAY.
- ``/early``: answered (200, END_STREAM) as soon as its HEADERS come, before its body.
- ``/rst-cancel``: the whole request read, then the stream reset ``CANCEL`` (the app gave up
  on a call it may have run).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.errors import ErrorCodes
from h2.events import (
    ConnectionTerminated,
    DataReceived,
    RequestReceived,
    StreamEnded,
    StreamReset,
    WindowUpdated,
)
from h2.exceptions import H2Error
from h2.settings import SettingCodes
from hyperframe.frame import DataFrame, HeadersFrame

Fields = list[tuple[bytes, bytes]]


@dataclass
class Seen:
    """What the peer saw."""

    streams: list[Fields] = field(default_factory=list)  # each stream's fields, in order
    resets: list[int] = field(default_factory=list)  # error codes of RST_STREAMs received
    connections: int = 0
    firsts: set[str] = field(default_factory=set)  # paths whose "once" behaviour has run
    open_streams: int = 0  # streams not yet ended or reset, now
    sent: int = 0  # body bytes of /big answers sent so far

    def paths(self) -> list[str]:
        return [dict(f)[b":path"].decode() for f in self.streams]


class _Conn(asyncio.Protocol):
    def __init__(self, seen: Seen, max_streams: int | None) -> None:
        self.seen = seen
        self.max_streams = max_streams
        self.h2 = H2Connection(H2Configuration(client_side=False, header_encoding=None))
        self.transport: asyncio.Transport | None = None
        self.bodies: dict[int, int] = {}
        self.fields: dict[int, Fields] = {}
        self.pending: dict[int, int] = {}  # how many bytes a /big stream still has to send
        self.live: set[int] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.seen.connections += 1
        self.h2.initiate_connection()
        if self.max_streams is not None:
            self.h2.update_settings({SettingCodes.MAX_CONCURRENT_STREAMS: self.max_streams})
        self.flush()

    def flush(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(self.h2.data_to_send())

    def data_received(self, data: bytes) -> None:
        try:
            events = self.h2.receive_data(data)
        except H2Error:
            self.flush()
            if self.transport is not None:
                self.transport.close()
            return
        for ev in events:
            if isinstance(ev, RequestReceived):
                self.fields[ev.stream_id] = list(ev.headers)
                self.bodies[ev.stream_id] = 0
                self.seen.streams.append(list(ev.headers))
                self.live.add(ev.stream_id)
                self.seen.open_streams += 1
                if dict(ev.headers)[b":path"] == b"/early":
                    self.h2.send_headers(ev.stream_id, [(b":status", b"200")])
                    self.h2.send_data(ev.stream_id, b"early", end_stream=True)
                    self.done(ev.stream_id)
            elif isinstance(ev, DataReceived):
                self.bodies[ev.stream_id] = self.bodies.get(ev.stream_id, 0) + len(ev.data)
                self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, StreamEnded):
                try:
                    self.answer(ev.stream_id)
                except H2Error:  # reset in the same read as its end (the frames came together)
                    self.done(ev.stream_id)
            elif isinstance(ev, StreamReset):
                self.seen.resets.append(int(ev.error_code))
                self.done(ev.stream_id)
                self.pending.pop(ev.stream_id, None)
            elif isinstance(ev, WindowUpdated):
                for sid in list(self.pending):
                    self.send_big(sid)
            elif isinstance(ev, ConnectionTerminated) and self.transport is not None:
                self.transport.close()
        self.flush()

    def done(self, sid: int) -> None:
        if sid in self.live:
            self.live.discard(sid)
            self.seen.open_streams -= 1

    def answer(self, sid: int) -> None:
        fields = self.fields[sid]
        target = dict(fields)[b":path"].decode()
        path, _, query = target.partition("?")
        h2 = self.h2
        if path in ("/refuse-once", "/goaway-once") and path not in self.seen.firsts:
            self.seen.firsts.add(path)
            self.done(sid)
            if path == "/refuse-once":
                h2.reset_stream(sid, ErrorCodes.REFUSED_STREAM)
            else:
                h2.close_connection(ErrorCodes.NO_ERROR, last_stream_id=max(0, sid - 2))
                self.flush()
                assert self.transport is not None
                self.transport.close()
            return
        if path == "/goaway-then-answer":
            h2.close_connection(ErrorCodes.NO_ERROR, last_stream_id=sid)
            self.flush()
            head = HeadersFrame(sid)
            head.data = h2.encoder.encode(
                [(b":status", b"200"), (b"content-type", b"application/grpc")]
            )
            head.flags.add("END_HEADERS")
            data = DataFrame(sid)
            data.data = b"\x00\x00\x00\x00\x02ok"
            tail = HeadersFrame(sid)
            tail.data = h2.encoder.encode([(b"grpc-status", b"0")])
            tail.flags.add("END_HEADERS")
            tail.flags.add("END_STREAM")
            assert self.transport is not None
            self.transport.write(head.serialize() + data.serialize() + tail.serialize())
            self.done(sid)
            return
        if path == "/rst-cancel":
            h2.reset_stream(sid, ErrorCodes.CANCEL)
            self.done(sid)
            return
        if path == "/trailers":
            h2.send_headers(sid, [(b":status", b"200")])
            h2.send_data(sid, b"body")
            h2.send_headers(sid, [(b"x-checksum", b"1")], end_stream=True)
            self.done(sid)
        elif path == "/hold":
            h2.send_headers(sid, [(b":status", b"200")])
            h2.send_data(sid, b"first")
        elif path == "/big":
            n = int(query.partition("=")[2] or "0")
            h2.send_headers(sid, [(b":status", b"200"), (b"content-length", b"%d" % n)])
            self.pending[sid] = n
            self.send_big(sid)
        elif path == "/status":
            code = query.partition("=")[2].encode()
            h2.send_headers(sid, [(b":status", code)], end_stream=True)
            self.done(sid)
        else:
            body = json.dumps(
                {
                    "fields": [[k.decode(), v.decode()] for k, v in fields],
                    "body": self.bodies.get(sid, 0),
                }
            ).encode()
            h2.send_headers(sid, [(b":status", b"200"), (b"content-type", b"application/json")])
            h2.send_data(sid, body, end_stream=True)
            self.done(sid)

    def send_big(self, sid: int) -> None:
        left = self.pending.get(sid)
        if left is None:
            return
        h2 = self.h2
        try:
            while left:
                n = min(h2.local_flow_control_window(sid), h2.max_outbound_frame_size, left)
                if n <= 0:
                    break
                h2.send_data(sid, b"x" * n)
                self.seen.sent += n
                left -= n
            if left:
                self.pending[sid] = left
            else:
                del self.pending[sid]
                h2.end_stream(sid)
                self.done(sid)
        except H2Error:
            self.pending.pop(sid, None)
        self.flush()


@asynccontextmanager
async def serving(max_streams: int | None = None) -> AsyncIterator[tuple[int, Seen]]:
    """The peer on a free loopback port: (port, what it saw). ``max_streams``: the
    SETTINGS_MAX_CONCURRENT_STREAMS it advertises (and enforces: h2 refuses more)."""
    seen = Seen()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Conn(seen, max_streams), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port, seen
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), 5)

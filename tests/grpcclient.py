"""gRPC clients for the tests: grpcio's (stub-less calls on raw bytes, any of the four kinds,
to any target) and a raw HTTP/2 one on the ``h2`` state machine, for what grpcio hides (the
frames of a Trailers-Only answer, request headers grpcio will not send).

grpcio's own retries are off on every channel made here (``grpc.enable_retries`` 0): what a
test sees retried was retried by the proxy under test, not by the client.

The grpcio calls block (grpcio's threaded API, never bound to an event loop); an async test
runs them with ``asyncio.to_thread`` (``acall``) or starts one and waits for it
(``start(...)`` then ``await asyncio.to_thread(running.result)``).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import grpc
import h2.config
import h2.connection
import h2.events

from tests import grpcpeers

Kind = Literal["unary", "server_stream", "client_stream", "bidi"]
KINDS: dict[str, Kind] = {
    grpcpeers.UNARY: "unary",
    grpcpeers.SERVER_STREAM: "server_stream",
    grpcpeers.CLIENT_STREAM: "client_stream",
    grpcpeers.BIDI: "bidi",
}
OPTIONS = [("grpc.enable_retries", 0)]
Metadata = tuple[tuple[str, str | bytes], ...]


@dataclass(frozen=True)
class Answer:
    """What a grpcio client got: the status, its details, the response messages, the response
    headers (initial metadata) and the trailers (trailing metadata)."""

    code: grpc.StatusCode
    details: str
    messages: tuple[bytes, ...]
    initial: Metadata
    trailing: Metadata

    def trailer(self, name: str) -> str | bytes | None:
        return next((v for k, v in self.trailing if k == name), None)


def _pairs(md: Any) -> Metadata:
    return tuple((m.key, m.value) for m in md or ())


class Running:
    """One call under way in its own thread. ``messages`` fills as responses arrive;
    ``cancel()`` cancels it (RST_STREAM CANCEL on the wire) at any point; ``result()`` waits."""

    def __init__(
        self,
        target: str,
        method: str,
        requests: Sequence[bytes],
        *,
        kind: Kind | None = None,
        timeout: float | None = 10.0,
        metadata: Metadata = (),
        pingpong: bool = False,
    ) -> None:
        self.method, self.requests = method, list(requests)
        self.kind: Kind = kind or KINDS[method]
        self.timeout, self.metadata, self.pingpong = timeout, metadata, pingpong
        self.messages: list[bytes] = []
        self.channel = grpc.insecure_channel(target, options=OPTIONS)
        self._call: Any = None
        self._cancel = False
        self._lock = threading.Lock()
        self._echoed: queue.Queue[None] = queue.Queue()
        self._answer: Answer | None = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="grpcclient")
        self._thread.start()

    def _outgoing(self) -> Any:
        """The request stream; ping-pong: each message after the previous one's echo."""
        for i, r in enumerate(self.requests):
            if self.pingpong and i:
                while True:
                    try:
                        self._echoed.get(timeout=0.1)
                        break
                    except queue.Empty:
                        if self._done.is_set() or self._cancel:
                            return
            yield r

    def _started(self, call: Any) -> None:
        with self._lock:
            self._call = call
            if self._cancel:
                call.cancel()

    def _run(self) -> None:
        kw: dict[str, Any] = {"timeout": self.timeout, "metadata": self.metadata or None}
        ch, m = self.channel, self.method
        try:
            if self.kind in ("unary", "client_stream"):
                if self.kind == "unary":
                    fut = ch.unary_unary(m).future(self.requests[0], **kw)
                else:
                    fut = ch.stream_unary(m).future(self._outgoing(), **kw)
                self._started(fut)
                with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
                    self.messages.append(fut.result())
                call = fut
            else:
                if self.kind == "server_stream":
                    call = ch.unary_stream(m)(self.requests[0], **kw)
                else:
                    call = ch.stream_stream(m)(self._outgoing(), **kw)
                self._started(call)
                try:
                    for msg in call:
                        self.messages.append(msg)
                        self._echoed.put(None)
                except grpc.RpcError:
                    pass
            self._answer = Answer(
                call.code(),
                call.details() or "",
                tuple(self.messages),
                _pairs(call.initial_metadata()),
                _pairs(call.trailing_metadata()),
            )
        except BaseException as e:  # handed to result()
            self._error = e
        finally:
            self._done.set()
            self.channel.close()

    def cancel(self) -> None:
        with self._lock:
            self._cancel = True
            if self._call is not None:
                self._call.cancel()

    def result(self, timeout: float = 30.0) -> Answer:
        if not self._done.wait(timeout):
            self.cancel()
            raise TimeoutError(f"{self.method} did not end within {timeout} s")
        if self._error is not None:
            raise self._error
        assert self._answer is not None
        return self._answer


def start(target: str, method: str, requests: Sequence[bytes] = (b"x",), **kw: Any) -> Running:
    """Start a call (keyword arguments: ``Running``'s) and return at once."""
    return Running(target, method, requests, **kw)


def call(target: str, method: str, requests: Sequence[bytes] = (b"x",), **kw: Any) -> Answer:
    """One call to ``target`` ("127.0.0.1:PORT"), waited for. ``requests``: the request
    message (unary, server stream: the first) or stream; keywords: ``kind`` (from the method
    name for test.Echo's), ``timeout`` (the deadline, sent as grpc-timeout; None: none),
    ``metadata``, ``pingpong`` (bidi: send each message after the previous one's echo)."""
    running = Running(target, method, requests, **kw)
    wait = 30.0 if running.timeout is None else running.timeout + 15.0
    return running.result(wait)


async def acall(target: str, method: str, requests: Sequence[bytes] = (b"x",), **kw: Any) -> Answer:
    """``call`` from async code, off the event loop."""
    return await asyncio.to_thread(call, target, method, requests, **kw)


# -- a raw HTTP/2 client -----------------------------------------------------------------------


def frame(message: bytes) -> bytes:
    """A gRPC length-prefixed message, uncompressed."""
    return b"\0" + len(message).to_bytes(4, "big") + message


def unframe(data: bytes) -> list[bytes]:
    out, i = [], 0
    while i + 5 <= len(data):
        n = int.from_bytes(data[i + 1 : i + 5], "big")
        out.append(data[i + 5 : i + 5 + n])
        i += 5 + n
    return out


@dataclass
class RawAnswer:
    """One stream's answer as frames delivered it: the response HEADERS, the DATA, the
    trailers; ``trailers_only``: the answer was one HEADERS frame with END_STREAM."""

    headers: list[tuple[str, str]] = field(default_factory=list)
    data: bytes = b""
    trailers: list[tuple[str, str]] = field(default_factory=list)
    trailers_only: bool = False
    reset: int | None = None  # RST_STREAM's error code, if the stream was reset

    @property
    def status(self) -> str | None:
        """grpc-status, from the trailers or from a Trailers-Only answer's headers."""
        for k, v in self.trailers or (self.headers if self.trailers_only else []):
            if k == "grpc-status":
                return v
        return None

    @property
    def messages(self) -> list[bytes]:
        return unframe(self.data)


def raw_call(
    port: int,
    path: str,
    messages: Sequence[bytes] = (b"x",),
    headers: Sequence[tuple[str, str]] = (),
    timeout: float = 10.0,
) -> RawAnswer:
    """A gRPC call over h2c with prior knowledge, sent by hand: the standard request headers
    plus ``headers`` (any, ``grpc-previous-rpc-attempts`` or ``grpc-timeout`` included), the
    ``messages`` framed, END_STREAM; reads until the stream ends or is reset."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(header_encoding="utf-8"))
    conn.initiate_connection()
    conn.send_headers(
        1,
        [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", path),
            (":authority", f"127.0.0.1:{port}"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *headers,
        ],
    )
    conn.send_data(1, b"".join(frame(m) for m in messages), end_stream=True)
    out = RawAnswer()
    deadline = time.monotonic() + timeout
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(conn.data_to_send())
        while True:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"connection closed before stream 1 ended: {out}")
            for ev in conn.receive_data(data):
                if isinstance(ev, h2.events.ResponseReceived):
                    out.headers = [(str(k), str(v)) for k, v in ev.headers]
                    out.trailers_only = ev.stream_ended is not None
                elif isinstance(ev, h2.events.DataReceived):
                    out.data += ev.data
                    conn.acknowledge_received_data(ev.flow_controlled_length, 1)
                elif isinstance(ev, h2.events.TrailersReceived):
                    out.trailers = [(str(k), str(v)) for k, v in ev.headers]
                elif isinstance(ev, h2.events.StreamReset):
                    out.reset = int(ev.error_code)
                    return out
                if isinstance(ev, h2.events.StreamEnded) or getattr(ev, "stream_ended", None):
                    return out
            sock.sendall(conn.data_to_send())

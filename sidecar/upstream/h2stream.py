"""One request's stream on an HTTP/2 upstream connection: the fields it is sent with, what
came back (head, body, trailers, a gRPC status before commit), the wait for its head, and how it
is given back (``h2pool`` tells the story).
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Protocol

from h2.errors import ErrorCodes

from sidecar import outcomes
from sidecar.core import (
    AttemptTimeout,
    BodyTimeout,
    UpstreamError,
    UpstreamReset,
)


class ExchangeOwner(Protocol):
    """What an exchange asks of its connection (``h2link.H2Link``)."""

    loop: asyncio.AbstractEventLoop

    def consumed(self, ex: H2Exchange, n: int) -> None: ...

    def reset(self, ex: H2Exchange) -> None: ...

    def forget(self, ex: H2Exchange) -> None: ...


Headers = list[tuple[bytes, bytes]]

# Connection-specific fields are malformed in HTTP/2 (RFC 9113 section 8.2.2); Host becomes
# :authority; TE is sent only as "trailers".
_NOT_SENT = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"transfer-encoding",
        b"upgrade",
        b"host",
        b"te",
        b"http2-settings",
    }
)
_PUSHBACK = b"grpc-retry-pushback-ms"
# What a gRPC call whose deadline passed while its answer streamed ends with (its upstream
# stream is reset): DEADLINE_EXCEEDED in the trailers, as a gRPC server ends it.
DEADLINE_TRAILERS: Headers = [
    (b"grpc-status", b"%d" % outcomes.DEADLINE.grpc),
    (b"grpc-message", b"the call's deadline passed while its answer streamed"),
    (b"x-retry-proxy-error", outcomes.DEADLINE.code.encode()),
]


def grpc_code_of_reset(code: int | None) -> int:
    """What a gRPC client makes of a stream reset (RST_STREAM ``code``) or, for None, of its
    connection lost, as gRPC's HTTP/2 transport maps them: CANCEL is CANCELLED,
    ENHANCE_YOUR_CALM RESOURCE_EXHAUSTED, INADEQUATE_SECURITY PERMISSION_DENIED, a lost
    connection UNAVAILABLE, any other code INTERNAL."""
    if code is None:
        return outcomes.GRPC_UNAVAILABLE
    return _RESET_CODES.get(code, outcomes.GRPC_INTERNAL)


_RESET_CODES = {
    int(ErrorCodes.CANCEL): outcomes.GRPC_CANCELLED,
    int(ErrorCodes.ENHANCE_YOUR_CALM): outcomes.GRPC_RETRY_ON["resource-exhausted"],
    int(ErrorCodes.INADEQUATE_SECURITY): 7,  # PERMISSION_DENIED
}


def request_fields(head: bytes, scheme: bytes, grpc: bool) -> Headers:
    """An HTTP/1.1 request head (the one the engine builds for every protocol) as HTTP/2
    fields: the request line as pseudo-headers, Host as ``:authority``, names lower case,
    connection-specific fields dropped (RFC 9113 section 8.2)."""
    lines = head.split(b"\r\n")
    method, target, _ = lines[0].split(b" ", 2)
    authority = b""
    fields: Headers = []
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname in _NOT_SENT:
            if lname == b"host":
                authority = value.strip()
            continue
        fields.append((lname, value.strip()))
    out: Headers = [
        (b":method", method),
        (b":scheme", scheme),
        (b":authority", authority),
        (b":path", target),
    ]
    if grpc:
        out.append((b"te", b"trailers"))
    return out + fields


def grpc_status_of(fields: Headers) -> tuple[int, bytes | None]:
    """The ``grpc-status`` (-1 when absent; UNKNOWN when not a number, as gRPC reads it) and
    the raw ``grpc-retry-pushback-ms`` of a Trailers-Only head or of trailers."""
    status = -1
    pushback = None
    for k, v in fields:
        if k == b"grpc-status":
            status = outcomes.grpc_status_value(v)
        elif k == _PUSHBACK:
            pushback = v
    return status, pushback


class H2Exchange:
    """One request's stream on a link (see the module docstring for who owns it)."""

    def __init__(self, link: ExchangeOwner, stream_id: int, head_only: bool, grpc: bool) -> None:
        self.link = link
        self.id = stream_id
        self.head_only = head_only
        self.grpc = grpc
        self.status = 0
        self.headers: Headers = []
        self.interim: list[tuple[int, Headers]] = []
        self.trailers: Headers | None = None
        self.body: deque[bytes] = deque()
        self.buffered = 0
        self.data_seen = False  # a DATA frame came (a gRPC message: the call is committed)
        self.ended = False  # END_STREAM from the upstream
        self.error: UpstreamError | None = None
        self.grpc_status = -1
        self.pushback: bytes | None = None
        self.sender: asyncio.Task[None] | None = None
        self.abandoned = False  # answered before the request body was all sent
        self.done = False  # given back (finish or cancel)
        # A gRPC call's deadline (loop time, from the grpc-timeout it was sent with): its
        # answer is cut there, however it streams. None: no deadline.
        self.deadline: float | None = None
        self._waiter: asyncio.Future[bool] | None = None

    @property
    def has_head(self) -> bool:
        return self.status != 0

    def wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(True)

    async def wait(self, timeout: float) -> bool:
        """Wait for news (head, data, end, error) at most ``timeout``; False when it passed."""
        return await _wait(self.link.loop, self, timeout)

    def fail(self, err: UpstreamError, reset: int | None = None) -> None:
        """The stream failed with ``err``; ``reset``: the RST_STREAM code it was reset with
        (None: the connection was lost). A gRPC call's failure after its request may have
        reached the upstream is given the status gRPC reads it as, which ``retry_on`` judges
        (never the ``reset`` word: a call the upstream may have run is retried only for a
        status the route lists)."""
        if self.error is None and not (self.ended and self.has_head):
            if self.grpc and isinstance(err, UpstreamReset) and not isinstance(err, BodyFailed):
                err.grpc = grpc_code_of_reset(reset)
            self.error = err
        self.wake()

    async def read_chunk(self, idle_timeout: float) -> bytes:
        """The next body bytes (b"" at the end); the stream's window is opened by what is read.
        Raises the stream's error, or BodyTimeout after ``idle_timeout`` of silence."""
        while True:
            if self.body:
                data = self.body.popleft()
                self.buffered -= len(data)
                self.link.consumed(self, len(data))
                return data
            if self.ended:
                return b""
            if self.error is not None:
                raise self.error
            wait = idle_timeout
            if self.deadline is not None:
                left = self.deadline - self.link.loop.time()
                if left <= 0:
                    self.expire()
                    continue
                wait = min(wait, left)
            if not await self.wait(wait):
                if self.deadline is not None and wait < idle_timeout:
                    continue  # the deadline: expired on the next turn
                raise BodyTimeout(
                    f"the upstream sent no body bytes for {idle_timeout:g}s",
                    "http_response_timeout",
                )

    def expire(self) -> None:
        """The gRPC call's deadline passed before its answer ended: the upstream stream is
        reset (CANCEL) and the answer ends with DEADLINE_EXCEEDED trailers."""
        self.link.reset(self)
        self.trailers = list(DEADLINE_TRAILERS)
        self.ended = True
        self.body.clear()
        if self.buffered:
            self.link.consumed(self, self.buffered)
        self.buffered = 0

    def take_body(self) -> bytes:
        body = b"".join(self.body)
        self.body.clear()
        if self.buffered:
            self.link.consumed(self, self.buffered)
        self.buffered = 0
        return body

    def finish(self) -> None:
        """Given back after the body was read to its end (or not wanted: ``cancel`` if the
        stream is still open)."""
        if self.done:
            return
        if not self.ended or self.error is not None or self.sender_running():
            self.cancel()
            return
        self.done = True
        # Answered before its request body was all sent: our side of the stream is still open
        # (it would hold one of the connection's streams for good); reset ends it. A stream
        # closed both ways is left as it is.
        self.link.reset(self)
        self.link.forget(self)

    def sender_running(self) -> bool:
        return self.sender is not None and not self.sender.done()

    def cancel(self) -> None:
        """Given back before the end: the stream is reset (CANCEL), its sender stopped."""
        if self.done:
            return
        self.done = True
        if self.sender is not None:
            self.sender.cancel()
        self.link.reset(self)
        self.link.forget(self)


def expire(w: asyncio.Future[bool]) -> None:
    if not w.done():
        w.set_result(False)


async def _wait(loop: asyncio.AbstractEventLoop, ex: H2Exchange, timeout: float) -> bool:
    w: asyncio.Future[bool] = loop.create_future()
    ex._waiter = w
    handle = loop.call_later(max(timeout, 0.0), expire, w)
    try:
        return await w
    finally:
        handle.cancel()
        if ex._waiter is w:
            ex._waiter = None


class BodyFailed(UpstreamReset):
    """The client's request body failed while it was sent (``cause`` is re-raised to the
    handler, which answers it as for an HTTP/1.1 upload)."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(f"the request body failed: {cause}")
        self.cause = cause


async def wait_head(ex: H2Exchange, timeout: float) -> None:
    loop = ex.link.loop
    end = loop.time() + timeout
    while not ex.has_head:
        if ex.error is not None:
            err = ex.error
            if isinstance(err, BodyFailed):
                raise err.cause
            raise err
        left = end - loop.time()
        if left <= 0 or not await ex.wait(left):
            raise AttemptTimeout("no response head within the per-try timeout")
    if ex.grpc and ex.status == 200:
        # Not committed until the first message or the end (gRFC A6): a status in the
        # trailers of an answer without a message may still be retried.
        while not (ex.data_seen or ex.ended or ex.error is not None):
            left = end - loop.time()
            if left <= 0 or not await ex.wait(left):
                break  # slow to its first message: relayed as it is, never failed for it

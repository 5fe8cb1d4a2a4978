"""What a front end gives the request path, and what it takes back: no protocol named.

A front end (``proxy/h1.py``: HTTP/1.1 on aiohttp's server; ``proxy/h2conn.py``: HTTP/2 on the
``h2`` package) turns each client request into one ``ClientRequest`` -- method, target,
headers, a body stream, who sent it, over TLS or not -- and gives a ``ResponseSink`` that the
answer goes out through: its interim answers (1xx), its head, its body in chunks, its trailers,
its end, or a cut when it cannot be completed; and it says whether the client is still there.
The path
(``admission`` .. ``relay``) reads and writes only these, so an HTTP/2 stream is one more
implementation of each, and the held answer of a guarded write is one more sink
(``proxy/held.py``).

Framing is the sink's business: an HTTP/1.1 sink chooses Content-Length, chunked or a close, and
whether the connection stays open; an HTTP/2 sink would send HEADERS and DATA frames, and the
trailers as a last HEADERS frame. ``Head.close`` says the request's connection must not be
reused (its body was not read whole): an HTTP/1.1 sink closes it, an HTTP/2 one need not.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final, Protocol

from multidict import CIMultiDictProxy

RawHeaders = list[tuple[bytes, bytes]]
ReceivedHeaders = Sequence[tuple[bytes, bytes]]  # as a front end parsed them, never changed


class RequestBody(Protocol):
    """A client request's body as it arrives. ``read`` returns b"" at its end, and raises
    ``body.BodyMalformed`` (framing broken) or ``body.ClientGone`` (the client left)."""

    async def read(self, n: int) -> bytes: ...


class ClientRequest:
    """One client request, as every front end makes it (see the module docstring)."""

    __slots__ = (
        "body",
        "client_cert",
        "content_length",
        "fields",
        "has_body",
        "method",
        "peer",
        "raw_headers",
        "target",
        "tls",
        "version",
    )

    def __init__(
        self,
        method: str,
        target: str,
        raw_headers: ReceivedHeaders,
        fields: CIMultiDictProxy[str],
        *,
        version: tuple[int, int],
        body: RequestBody,
        has_body: bool,
        content_length: int | None,
        peer: str,
        tls: bool,
        client_cert: bytes | None = None,
    ) -> None:
        self.method: Final = method
        self.target: Final = target  # as sent (origin-form, or absolute-form on HTTP/1.1)
        self.raw_headers: Final = raw_headers  # the fields as received, bytes, in order
        self.fields: Final = fields  # the same, looked up by name (case-insensitive)
        self.version: Final = version  # (1, 0), (1, 1) or (2, 0)
        self.body: Final = body
        self.has_body: Final = has_body  # a body follows (it may still be empty)
        self.content_length: Final = content_length  # declared, else None
        self.peer: Final = peer  # the client's address ("" when unknown)
        self.tls: Final = tls  # the connection is TLS
        # its client certificate as X-Forwarded-Client-Cert's value (mutual TLS), else None
        self.client_cert: Final = client_cert


class Head:
    """The head of an answer: status, the fields relayed as they came (``fields``: the
    upstream's, hop-by-hop ones out; all of them for an answer the sidecar made), the
    sidecar's own fields written after them, the body length when known, and whether the
    request's connection must not be reused. Not written, read by a held answer's guard
    (``proxy/held.py``): ``from_upstream``, the head is the upstream's (the app acted), and
    ``upstream_error``, the x-retry-proxy-error of a sidecar further down that made it."""

    __slots__ = ("close", "fields", "from_upstream", "length", "own", "status", "upstream_error")

    def __init__(
        self,
        status: int,
        fields: RawHeaders,
        own: RawHeaders,
        length: int | None,
        close: bool = False,
        *,
        from_upstream: bool = False,
        upstream_error: bytes | None = None,
    ) -> None:
        self.status: Final = status
        self.fields: Final = fields
        self.own: Final = own
        self.length: Final = length
        self.close: Final = close
        self.from_upstream: Final = from_upstream
        self.upstream_error: Final = upstream_error


class ResponseSink(Protocol):
    """Where the answer of one request goes (see the module docstring). Every write raises
    ``ConnectionError`` when the client has gone."""

    @property
    def whole_limit(self) -> int:
        """An upstream body complete in memory up to this size is given whole (``whole``);
        a larger one is streamed."""
        ...

    @property
    def sent(self) -> int:
        """Body bytes written to the client so far."""
        ...

    def gone(self) -> bool:
        """Whether the client has left (its connection or stream is closing)."""
        ...

    async def interim(self, status: int, fields: RawHeaders) -> None:
        """A 1xx answer before the final one (dropped where the protocol has none)."""
        ...

    def whole(self, head: Head, body: bytes) -> None:
        """The whole answer at once: head and body."""
        ...

    async def start(self, head: Head) -> None:
        """The head of an answer whose body follows in ``write`` calls."""
        ...

    async def write(self, chunk: bytes) -> None: ...

    async def end(self, trailers: RawHeaders | None = None) -> None:
        """The body ended (with trailers, where the protocol carries them)."""
        ...

    def abort(self) -> None:
        """The answer cannot be completed (its upstream broke mid-body, the request cannot
        be answered at all): the client must see it cut, never a truncated whole answer."""
        ...

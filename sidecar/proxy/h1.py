"""The HTTP/1.1 front end: a request of aiohttp's low-level server (``proxy/server.py``) made
into the path's ``ClientRequest``, and ``H1Sink``, the ``ResponseSink`` that writes its answer
(``proxy/frontend.py``).

The sink writes the head and the body itself, from raw bytes: the upstream's fields exactly as
they came (aiohttp would re-encode str headers as UTF-8, turning an obs-text
``filename="ü.txt"`` into mojibake; nginx and Envoy copy the bytes), then the framing it chooses
(Content-Length kept, chunked otherwise on HTTP/1.1, close-delimited on HTTP/1.0), whether the
connection stays open, then the sidecar's own fields. A whole answer is one write. Every write
goes through the request's aiohttp ``StreamWriter`` (its ``_write``: the same check that the
client's transport is not closing, raising ``ConnectionResetError`` when it is; and its
``drain`` for the client's back-pressure), so aiohttp's accounting stays right.

It is not an aiohttp response class (mypyc compiles it, where a subclass of aiohttp's
``StreamResponse`` stayed interpreted): the handler returns it to aiohttp, which only asks a
response for ``prepare``, ``write_eof`` and ``keep_alive`` once the handler is done; by then
the sink has written everything, so the first two do nothing.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, cast

from aiohttp import ClientPayloadError, StreamReader, web
from aiohttp.helpers import must_be_empty_body
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_writer import StreamWriter
from aiohttp.streams import EmptyStreamReader

from sidecar.proxy.body import BodyMalformed, ClientGone
from sidecar.proxy.frontend import ClientRequest, Head, RawHeaders
from sidecar.proxy.server import GuardedRequestHandler, transport_peer

FULL_RESPONSE_MAX = 64 * 1024  # complete bodies up to this go out in one write
_REASONS: dict[int, bytes] = {s.value: s.phrase.encode("latin-1") for s in HTTPStatus}


class H1Body:
    """The body of an HTTP/1.1 request, read from aiohttp's parser."""

    __slots__ = ("_content",)

    def __init__(self, content: StreamReader) -> None:
        self._content = content

    async def read(self, n: int) -> bytes:
        try:
            return await self._content.read(n)
        except HttpProcessingError as bad:  # set on the body by the server (proxy/server.py)
            raise BodyMalformed(f"the request body is malformed: {bad.message}") from None
        except (ConnectionError, ClientPayloadError) as lost:
            raise ClientGone(f"the client left during its upload: {lost}") from None


def parsed(request: web.BaseRequest) -> Any:
    """aiohttp's parsed message of ``request``. Read untyped: its stub says a NamedTuple, but
    the C parser makes its own class, which the compiled build would refuse as "not a tuple"."""
    return getattr(request, "_message")  # noqa: B009


def client_request(request: web.BaseRequest) -> ClientRequest:
    """The path's request for one of aiohttp's, read from its parsed message (the request's own
    properties are Python-level code around the same fields)."""
    msg = parsed(request)
    proto = request.protocol
    transport = request.transport
    guarded = proto if isinstance(proto, GuardedRequestHandler) else None
    peer = guarded.peer() if guarded is not None else transport_peer(transport)
    tls = transport is not None and transport.get_extra_info("sslcontext") is not None
    version = msg.version
    payload = request._payload
    length = msg.headers.get("Content-Length")  # its digits checked by the parser
    return ClientRequest(
        msg.method,
        msg.path,
        msg.raw_headers,
        msg.headers,
        version=(version.major, version.minor),
        body=H1Body(payload),
        has_body=type(payload) is not EmptyStreamReader,
        content_length=int(length) if length is not None else None,
        peer=peer,
        tls=tls,
        client_cert=guarded.client_cert() if tls and guarded is not None else None,
    )


def interim_head(status: int, fields: RawHeaders) -> bytes:
    """A 1xx response, its fields relayed byte for byte; the reason phrase is the standard
    one (not copied, as for final responses)."""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b""))]
    parts.extend(k + b": " + v + b"\r\n" for k, v in fields)
    parts.append(b"\r\n")
    return b"".join(parts)


class H1Sink:
    """The answer to one HTTP/1.1 request (see the module docstring)."""

    __slots__ = (
        "_chunked",
        "_empty",
        "_keep_alive",
        "_method",
        "_sent",
        "_version",
        "_writer",
        "request",
    )

    def __init__(self, request: web.BaseRequest) -> None:
        self.request = request  # what a tunnel takes over (proxy/tunnel.py)
        msg = parsed(request)
        self._writer = cast(StreamWriter, request._payload_writer)
        self._method = msg.method
        version = msg.version
        self._version = (version.major, version.minor)
        self._keep_alive = not msg.should_close
        self._chunked = False
        self._empty = False  # HEAD, 1xx, 204, 304: a head only
        self._sent = 0

    # -- what aiohttp asks of the response its handler returned -----------------------------

    async def prepare(self, request: web.BaseRequest) -> None:
        return None  # written already

    async def write_eof(self, data: bytes = b"") -> None:
        return None

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive

    # -- the ResponseSink --------------------------------------------------------------------

    @property
    def whole_limit(self) -> int:
        return FULL_RESPONSE_MAX

    @property
    def sent(self) -> int:
        return self._sent

    def gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    async def interim(self, status: int, fields: RawHeaders) -> None:
        # RFC 9110 section 15.2: a proxy forwards 1xx responses, never to HTTP/1.0.
        if self._version >= (1, 1):
            self._writer._write(interim_head(status, fields))

    def whole(self, head: Head, body: bytes) -> None:
        chunked = self._framing(head)
        if self._empty:
            payload = b""
        elif chunked:
            payload = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
        else:
            payload = body
        self._writer._write(self._head(head, chunked) + payload)
        self._sent = 0 if self._empty else len(body)

    async def start(self, head: Head) -> None:
        self._chunked = self._framing(head)
        self._writer._write(self._head(head, self._chunked))

    async def write(self, chunk: bytes) -> None:
        if self._empty or not chunk:
            return
        writer = self._writer
        if self._chunked:
            writer._writelines((b"%x\r\n" % len(chunk), chunk, b"\r\n"))
        else:
            writer._write(chunk)
        self._sent += len(chunk)
        await writer.drain()

    async def end(self, trailers: RawHeaders | None = None) -> None:
        if self._chunked and not self._empty:
            last = [b"0\r\n"]
            if trailers:
                last.extend(k + b": " + v + b"\r\n" for k, v in trailers)
            last.append(b"\r\n")
            self._writer._write(b"".join(last))

    def hand_over(self) -> None:
        """The connection is a tunnel's from now on (``proxy/tunnel.py``): never reused."""
        self._keep_alive = False

    def abort(self) -> None:
        self._keep_alive = False
        transport = self.request.transport
        if transport is not None:
            transport.abort()

    # -- framing -----------------------------------------------------------------------------

    def _framing(self, head: Head) -> bool:
        """Whether the body goes chunked; the keep-alive decision is kept (as aiohttp's)."""
        self._empty = empty = must_be_empty_body(self._method, head.status)
        if head.close:
            self._keep_alive = False
        if head.length is not None or empty:
            return False
        if self._version >= (1, 1):
            return True
        # HTTP/1.0 and no length: the body ends when the connection closes.
        self._keep_alive = False
        return False

    def _head(self, head: Head, chunked: bool) -> bytes:
        """Status line, the fields as they came, the framing fields, the sidecar's own."""
        version = self._version
        status = head.status
        parts = [
            b"HTTP/%d.%d %d %s\r\n" % (version[0], version[1], status, _REASONS.get(status, b""))
        ]
        for k, v in head.fields:
            parts.append(k + b": " + v + b"\r\n")
        if chunked:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        if self._keep_alive:
            if version == (1, 0):
                parts.append(b"Connection: keep-alive\r\n")
        elif version == (1, 1):
            parts.append(b"Connection: close\r\n")
        for k, v in head.own:
            parts.append(k + b": " + v + b"\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)

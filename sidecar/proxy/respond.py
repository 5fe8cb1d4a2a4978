"""Building client responses: relayed upstream responses and the sidecar's own answers.

A relayed response's head is written from the upstream's header bytes, exactly as they came
(aiohttp would re-encode str headers as UTF-8, turning an obs-text ``filename="ü.txt"`` into
mojibake; nginx and Envoy copy the bytes). aiohttp still decides the framing toward the client
(Content-Length kept, chunked otherwise on HTTP/1.1, close-delimited on HTTP/1.0) and whether
the connection stays open; only ``Transfer-Encoding`` and ``Connection`` are taken from it.

The sidecar's own answers carry ``x-retry-proxy-error`` and the standard ``Proxy-Status``
(RFC 9209), a ``Date``, and no ``Server`` version banner.
"""

from __future__ import annotations

import json
from http import HTTPStatus

from aiohttp import ClientConnectionResetError, web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.helpers import must_be_empty_body
from aiohttp.http import HttpVersion, HttpVersion10, HttpVersion11

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.outcomes import OutcomeRow

RawHeaders = list[tuple[bytes, bytes]]

PROXY_NAME = "retry-sidecar"  # the Proxy-Status member naming this intermediary


def proxy_status(error_type: str | None = None, received_status: int | None = None) -> str:
    value = PROXY_NAME if error_type is None else f"{PROXY_NAME}; error={error_type}"
    if received_status is not None:
        value += f"; received-status={received_status}"  # RFC 9209 section 2.1.4
    return value


class ProxyResponse(web.StreamResponse):
    """A relayed upstream response whose head is written from raw bytes.

    ``raw`` holds the upstream's headers to copy (hop-by-hop already removed), ``own`` the
    sidecar's additions. Headers are sent with the first body bytes (one write for a whole
    small response) unless ``flush_head`` asks for them at once (a stream that may pause).
    """

    def __init__(
        self,
        status: int,
        raw: RawHeaders,
        own: RawHeaders,
        content_length: int | None,
        flush_head: bool = False,
    ) -> None:
        super().__init__(status=status)
        self._raw = raw
        self._own = own
        self._send_headers_immediately = flush_head
        self._length = content_length  # announced by the upstream; None: chunked or EOF

    async def prepare(self, request: web.BaseRequest) -> AbstractStreamWriter | None:
        """aiohttp's ``prepare`` without its chain of coroutines (``_start``,
        ``_prepare_headers``, ``_prepare_hook``, ``_write_headers``), which cost more than the
        work on every relayed response. The hook has nothing to do under the low-level server
        (no application, no ``on_response_prepare`` signal)."""
        if self._eof_sent:
            return None
        if self._payload_writer is not None:
            return self._payload_writer
        self._must_be_empty_body = must_be_empty_body(request.method, self.status)
        self._req = request
        writer = self._payload_writer = request._payload_writer
        assert writer is not None
        chunked = self._framing(request)
        writer.length = self._length
        if chunked:
            writer.enable_chunking()
        # aiohttp's writer sends this buffer with the first body bytes (or at once below).
        writer._headers_buf = self._head(request.version, chunked)  # type: ignore[attr-defined]
        writer._headers_written = False  # type: ignore[attr-defined]
        if self._send_headers_immediately:
            writer.send_headers()
        return writer

    def send_whole(self, request: web.BaseRequest, body: bytes) -> None:
        """Send the whole response at once: head and body (chunk-framed when the upstream gave
        no length) in one write to the client's transport, then leave this object as aiohttp's
        ``prepare`` and ``write_eof`` would (EOF sent, keep-alive decided), so that aiohttp's
        own calls after the handler do nothing. For a body already complete in memory (the
        common small response), aiohttp's writer only added coroutines and buffer bookkeeping
        around the same single write. Raises ConnectionResetError, as aiohttp's writer does,
        when the client has gone."""
        self._must_be_empty_body = must_be_empty_body(request.method, self.status)
        chunked = self._framing(request)
        if self._must_be_empty_body:
            payload = b""
        elif chunked:
            payload = (b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)) if body else b"0\r\n\r\n"
        else:
            payload = body
        transport = request.transport
        if transport is None or transport.is_closing():
            raise ClientConnectionResetError("Cannot write to closing transport")
        transport.write(self._head(request.version, chunked) + payload)
        self._eof_sent = True
        self._body_length = len(payload)

    def _framing(self, req: web.BaseRequest) -> bool:
        """aiohttp's framing decisions, and only those (its own ``_prepare_headers`` also fills
        ``Date``, ``Server`` and ``Content-Type`` into a multidict that a relayed response never
        sends): whether the body goes chunked; the keep-alive decision is kept."""
        keep_alive = self._keep_alive
        if keep_alive is None:
            keep_alive = req.keep_alive
        chunked = False
        if self._length is None and not self._must_be_empty_body:
            if req.version >= HttpVersion11:
                chunked = True
            else:
                # HTTP/1.0 and no length: the body ends when the connection closes. (aiohttp's
                # own version forgets to close it, and an HTTP/1.0 keep-alive client then waits
                # for a close that never comes.)
                keep_alive = False
        self._keep_alive = keep_alive
        return chunked

    def _head(self, version: HttpVersion, chunked: bool) -> bytes:
        """Status line, the upstream's fields as they came, the framing fields, the sidecar's
        own fields."""
        parts = [
            b"HTTP/%d.%d %d %s\r\n"
            % (version.major, version.minor, self._status, self._reason.encode("latin-1"))
        ]
        for k, v in self._raw:
            parts.append(k + b": " + v + b"\r\n")
        if chunked:
            parts.append(b"Transfer-Encoding: chunked\r\n")
        if self._keep_alive:
            if version == HttpVersion10:
                parts.append(b"Connection: keep-alive\r\n")
        elif version == HttpVersion11:
            parts.append(b"Connection: close\r\n")
        for k, v in self._own:
            parts.append(k + b": " + v + b"\r\n")
        parts.append(b"\r\n")
        return b"".join(parts)


def interim_head(status: int, headers: RawHeaders) -> bytes:
    """A 1xx response, its headers relayed byte for byte; the reason phrase is the standard
    one (not copied, as for final responses)."""
    try:
        reason = HTTPStatus(status).phrase.encode()
    except ValueError:
        reason = b""
    parts = [b"HTTP/1.1 %d %s\r\n" % (status, reason)]
    parts.extend(k + b": " + v + b"\r\n" for k, v in headers)
    parts.append(b"\r\n")
    return b"".join(parts)


class SidecarResponse(web.Response):
    """An answer made by the sidecar itself: aiohttp's ``Server`` banner is removed."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.popall("Server", None)


def own_answer(
    row: OutcomeRow,
    fate: Fate,
    attempts: int,
    error_type: str | None = None,
    *,
    received_status: int | None = None,
    message: str | None = None,
) -> web.Response:
    """A response made by the sidecar itself, about the upstream or the route's policy: its
    status, ``x-retry-proxy-error``, ``Proxy-Status`` error and text from its row of the
    outcome table. ``error_type``: a more precise RFC 9209 error type than the row's (a connect
    failure that knows it was refused); ``received_status``: the status the upstream answered,
    when the sidecar did not relay it; ``message``: a text more precise than the row's."""
    assert row.status is not None, f"{row.name} is never an answer of the sidecar's"
    fate_s = fate.value
    text = row.message if message is None else message
    body = json.dumps({"error": text, "fate": fate_s, "attempts": attempts}).encode()
    return SidecarResponse(
        status=row.status,
        body=body,
        headers={
            "Content-Type": "application/json",
            "Proxy-Status": proxy_status(error_type or row.proxy_status, received_status),
            "x-retry-proxy-error": row.code,
            "x-retry-attempts": str(attempts),
            "x-retry-fate": fate_s,
        },
    )


def client_error(status: int, message: str) -> web.Response:
    """A 4xx for a request the sidecar refuses before routing it anywhere."""
    return SidecarResponse(
        status=status,
        body=json.dumps({"error": message}).encode(),
        headers={
            "Content-Type": "application/json",
            "Proxy-Status": proxy_status(
                outcomes.REFUSALS.get(status, outcomes.BAD_REQUEST.proxy_status)
            ),
            "x-retry-proxy-error": outcomes.BAD_REQUEST.code,
        },
    )

"""HTTP/2 to an upstream (a route's ``upstream_protocol: h2`` or ``auto``): connections driven by
the ``h2`` package's state machine (framing, HPACK, flow control: no framing code here), each
request one stream of a shared connection.

Ownership: an ``H2Pool`` (one per endpoint and TLS identity, as the HTTP/1.1 ``Pool``) owns its
connections (``H2Link``) and the one task that opens a new one (every request waiting for it
shares it, so a burst opens one connection, not one per request). A link owns its streams'
``H2Exchange``; an exchange is handed to exactly one caller, which gives it back with
``finish`` (the body read to its end) or ``cancel`` (anything else: RST_STREAM CANCEL, its body
sender stopped). A link with no stream for ``idle_timeout`` is closed; one whose peer sent GOAWAY
takes no new stream and closes when its last stream ends.

What was not processed: a stream the upstream refused (RST_STREAM REFUSED_STREAM before any
answer) or one above a GOAWAY's last stream id never reached the application (RFC 9113 section
8.7): it is a ``ConnectFailure`` (``refused_stream``), retried for any method as a connect
failure is.

Flow control bounds what is buffered: each stream's window is opened again only as its body is
read (``read_chunk``), so a slow client of a fast upstream holds at most the window per stream.
A request body is sent within the upstream's windows by a task the exchange owns, so that a
bidirectional stream (gRPC) can answer while the request still streams.

A gRPC call (``grpc``): its status is read from the headers of a Trailers-Only answer, or from
the trailers of an answer that ended without a message; such an answer is not yet committed
(gRFC A6) and the request returns only once the first message or the end has come (or the
time for the head has passed: then it is relayed as it is, never failed for being slow).
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator

from h2.exceptions import H2Error

from sidecar import outcomes
from sidecar.core import (
    ConnectFailure,
    NoTimeLeft,
    PoolExhausted,
    TlsHandshakeError,
    UpstreamError,
    UpstreamReset,
    connect_error_type,
)
from sidecar.upstream.h2link import H2Link
from sidecar.upstream.h2stream import BodyFailed, H2Exchange, request_fields, wait_head
from sidecar.upstream.tls import OK, TlsTarget, handshake_error


class H2Pool:
    """The HTTP/2 connections to one endpoint (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        settings: object,
        tls: TlsTarget | None,
        alpn: tuple[str, ...],
    ) -> None:
        self.loop = loop
        self.host = host
        self.port = port
        self.endpoint = f"{host}:{port}"
        self.tls = tls
        self.alpn = alpn
        self.max_connections: int = settings.max_connections  # type: ignore[attr-defined]
        self.connect_timeout: float = settings.connect_timeout  # type: ignore[attr-defined]
        self.idle_timeout: float = settings.idle_timeout  # type: ignore[attr-defined]
        self.links: list[H2Link] = []
        self._connecting: asyncio.Task[H2Link] | None = None
        self._closed = False

    def stats(self) -> tuple[int, int]:
        """(connections, idle connections)."""
        return len(self.links), sum(1 for lk in self.links if not lk.streams)

    def lost(self, link: H2Link) -> None:
        if link in self.links:
            self.links.remove(link)

    async def link(self, timeout: float) -> H2Link:
        """A connection with room for one more stream: an open one, or a new one (one opening
        at a time, shared by everyone who waits for it; those it has no room for, because the
        upstream allows fewer streams than wait, open the next)."""
        loop = self.loop
        if timeout <= 0 or min(timeout, self.connect_timeout) <= 0:
            raise NoTimeLeft("no time left to connect")
        end = loop.time() + min(timeout, self.connect_timeout)
        while True:
            if self._closed:
                raise ConnectFailure("the upstream client is shut down")
            for lk in self.links:
                if lk.has_room():
                    return lk
            if any(lk.refuses_streams() for lk in self.links):
                raise ConnectFailure(
                    f"{self.endpoint} allows no stream (SETTINGS_MAX_CONCURRENT_STREAMS 0)",
                    "connection_refused",
                )
            left = end - loop.time()
            if left <= 0:
                raise ConnectFailure(f"connect to {self.endpoint} timed out", "connection_timeout")
            task = self._connecting
            if task is None:
                if len(self.links) >= self.max_connections:
                    raise PoolExhausted("every upstream HTTP/2 connection is full")
                task = self._connecting = loop.create_task(self._connect())
                task.add_done_callback(self._connected)
            try:
                async with asyncio.timeout(left):
                    lk = await asyncio.shield(task)
            except TimeoutError:
                raise ConnectFailure(
                    f"connect to {self.endpoint} timed out", "connection_timeout"
                ) from None
            if lk.has_room():
                return lk
            if lk.refuses_streams():
                # SETTINGS_MAX_CONCURRENT_STREAMS 0: the upstream takes no stream now. One
                # connection learns it; opening more would only add to its load.
                raise ConnectFailure(
                    f"{self.endpoint} allows no stream (SETTINGS_MAX_CONCURRENT_STREAMS 0)",
                    "connection_refused",
                )

    def _connected(self, task: asyncio.Task[H2Link]) -> None:
        if self._connecting is task:
            self._connecting = None
        if not task.cancelled() and task.exception() is None:
            lk = task.result()
            if self._closed:
                lk.close()
            elif not lk.closed:
                self.links.append(lk)

    async def _connect(self) -> H2Link:
        def made() -> H2Link:
            return H2Link(self.loop, self.idle_timeout, self.lost)

        tls = self.tls
        where = self.endpoint if tls is None else f"{tls.server_name} ({self.endpoint})"
        try:
            async with asyncio.timeout(self.connect_timeout):
                if tls is None:
                    _, link = await self.loop.create_connection(made, self.host, self.port)
                else:
                    _, link = await self.loop.create_connection(
                        made,
                        self.host,
                        self.port,
                        ssl=tls.context.alpn_ssl(self.alpn),
                        server_hostname=tls.server_name,
                        ssl_handshake_timeout=self.connect_timeout,
                    )
        except TimeoutError:
            if tls is not None:
                tls.report(outcomes.CONNECT_FAILURE.name)
            raise ConnectFailure(f"connect to {where} timed out", "connection_timeout") from None
        except (OSError, socket.gaierror) as exc:
            refused = handshake_error(exc, where) if isinstance(exc, ssl.SSLError) else None
            if refused is not None:
                if tls is not None:
                    tls.report(refused.code, refused)
                raise refused from None
            if tls is not None:
                tls.report(outcomes.CONNECT_FAILURE.name)
            raise ConnectFailure(
                f"connect to {where} failed: {exc!r}", connect_error_type(exc)
            ) from None
        if tls is not None:
            tls.report(OK)
            if link.alpn != "h2":
                link.close()
                if "http/1.1" in self.alpn:
                    raise SpeaksHttp1(where)
                raise TlsHandshakeError(
                    f"{where} did not agree to HTTP/2 by ALPN (it chose {link.alpn or 'nothing'})",
                    "tls_protocol_error",
                )
        try:
            async with asyncio.timeout(self.connect_timeout):
                await asyncio.shield(link.ready)
        except (TimeoutError, ConnectionError):
            link.close()
            raise ConnectFailure(
                f"{where} sent no HTTP/2 SETTINGS (it does not speak HTTP/2?)", "connection_timeout"
            ) from None
        return link

    async def request(
        self,
        head: bytes,
        body: bytes | AsyncIterator[bytes] | None,
        timeout: float,
        head_only: bool,
        grpc: bool,
    ) -> H2Exchange:
        """Send one request on a stream and wait for its head (for a gRPC call: its first
        message or its end, see the module docstring); the caller owns the exchange returned.
        ``timeout`` bounds connecting and the wait for the head; the upstream must keep taking
        body bytes within it."""
        loop = self.loop
        started = loop.time()
        link = await self.link(timeout)
        if loop.time() - started >= timeout:
            raise NoTimeLeft("no time left to send the request")
        scheme = b"https" if self.tls is not None else b"http"
        fields = request_fields(head, scheme, grpc)
        inline = body is None or (isinstance(body, bytes) and not body)
        try:
            ex = link.open(fields, inline, head_only, grpc)
        except H2Error as exc:
            raise ConnectFailure(
                f"no stream on {self.endpoint}: {exc!r}", "connection_refused"
            ) from None
        if grpc:
            ex.deadline = _deadline(fields, started)
        try:
            if not inline:
                assert body is not None
                ex.sender = loop.create_task(_send(link, ex, body, timeout))
            await wait_head(ex, timeout - (loop.time() - started))
        except BaseException:
            ex.cancel()
            raise
        return ex

    def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        for lk in list(self.links):
            lk.close()
        self.links.clear()


def _deadline(fields: list[tuple[bytes, bytes]], started: float) -> float | None:
    """When a gRPC call sent with ``fields`` at ``started`` (loop time) is over: its
    ``grpc-timeout`` (milliseconds, as ``engine/sender.py`` writes the time left) from then."""
    for k, v in fields:
        if k == b"grpc-timeout" and v[-1:] == b"m" and v[:-1].isdigit():
            return started + int(v[:-1]) / 1000
    return None


class SpeaksHttp1(ConnectFailure):
    """An ``auto`` route's upstream chose HTTP/1.1 by ALPN: the client speaks HTTP/1.1 to it
    from then on. Nothing of the request was sent."""

    def __init__(self, where: str) -> None:
        super().__init__(f"{where} chose HTTP/1.1 by ALPN", "connection_refused")


async def _send(
    link: H2Link, ex: H2Exchange, body: bytes | AsyncIterator[bytes], idle: float
) -> None:
    """The exchange's body sender (its task): the body within the windows, then the end. An
    error ends the stream (reset) and is the exchange's error."""
    try:
        if isinstance(body, bytes):
            await link.send_body(ex, body, True, idle)
            return
        async for chunk in body:
            if not chunk:
                continue
            if not await link.send_body(ex, chunk, False, idle):
                ex.abandoned = True
                return
        if not (ex.ended or ex.error is not None):
            await link.send_body(ex, b"", True, idle)
    except asyncio.CancelledError:
        raise
    except UpstreamError as exc:
        ex.fail(exc)
        link.reset(ex)
    except TimeoutError:
        ex.fail(UpstreamReset(f"the upstream took no request body for {idle:g}s"))
        link.reset(ex)
    except Exception as exc:  # the client's body broke (gone, malformed, too large)
        ex.fail(BodyFailed(exc))
        link.reset(ex)

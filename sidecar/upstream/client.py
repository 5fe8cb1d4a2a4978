"""Send one request upstream, exactly once, and hand back a streaming response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from sidecar.config.tls import RouteTls
from sidecar.core import ConnectFailure, NoTimeLeft, UpstreamError, UpstreamReset
from sidecar.upstream.connection import Connection
from sidecar.upstream.h2pool import H2Pool, SpeaksHttp1
from sidecar.upstream.h2stream import H2Exchange
from sidecar.upstream.pool import Pool, PoolSettings, PoolStats
from sidecar.upstream.responsehead import read_fields
from sidecar.upstream.states import Req
from sidecar.upstream.tls import TlsContexts, TlsTarget
from sidecar.upstream.upload import send_stream

Headers = list[tuple[bytes, bytes]]
Body = bytes | AsyncIterator[bytes] | None


class Replay(Protocol):
    """A request stream sent as it arrives and kept for a retry while it fits (a gRPC call's
    messages: ``proxy/body.py``'s ``ReplayBody``)."""

    @property
    def replayable(self) -> bool:
        """Everything read so far is kept: a retry can send it again."""
        ...

    def stream(self) -> AsyncIterator[bytes]:
        """The body from its start: what is kept, then the rest as it arrives."""
        ...


class _Kept:
    """What a detached response still needs of its connection (see ``detach``)."""

    __slots__ = ("abandoned", "body", "content_length", "extra_data", "has_body")

    def __init__(
        self,
        content_length: int | None,
        has_body: bool,
        extra_data: bool,
        abandoned: bool,
        body: bytes,
    ) -> None:
        self.content_length = content_length
        self.has_body = has_body
        self.extra_data = extra_data
        self.abandoned = abandoned
        self.body = body


class UpstreamResponse:
    """A response whose head has arrived; the body streams with ``read_chunk``.

    Exactly one of ``release()`` (after the body was read to its end) or ``discard()`` must be
    called; both are idempotent. A complete small response can be ``detach``ed from its
    connection instead: it then holds nothing but its bytes.
    """

    __slots__ = (
        "_conn",
        "_done",
        "_kept",
        "_pool",
        "grpc_status",
        "headers",
        "interim",
        "proxy_error",
        "pushback",
        "retry_after",
        "status",
    )

    def __init__(self, pool: Pool, conn: Connection) -> None:
        self._pool = pool
        self._conn = conn
        self._done = False
        self._kept: _Kept | None = None  # set by detach: the connection is no longer ours
        self.status = conn.status
        self.headers = conn.headers
        # 1xx responses (other than 100) that came before this one: (status, headers).
        self.interim = conn.interim
        # Read while the head was parsed (no second scan of the headers for them).
        self.retry_after = conn.retry_after
        self.proxy_error = conn.proxy_error  # x-retry-proxy-error, set by an inner sidecar
        # A gRPC call's status while it is not committed (an HTTP/2 upstream's Trailers-Only
        # answer, or trailers with no message), else -1; and its grpc-retry-pushback-ms.
        self.grpc_status = -1
        self.pushback: bytes | None = None

    @property
    def trailers(self) -> list[tuple[bytes, bytes]] | None:
        """The trailers, once the body has ended (HTTP/2 upstreams; HTTP/1.1 ones: none)."""
        return None

    @property
    def endpoint(self) -> str:
        """The upstream endpoint that answered, ``host:port``."""
        return self._pool.endpoint

    @property
    def content_length(self) -> int | None:
        """The body length the upstream announced (None when chunked or close-delimited)."""
        k = self._kept
        return self._conn.content_length if k is None else k.content_length

    @property
    def has_body(self) -> bool:
        k = self._kept
        if k is not None:
            return k.has_body
        return not (self._conn.head_only or self.status in (204, 304))

    @property
    def complete(self) -> bool:
        """The whole response, body included, has arrived."""
        return self._kept is not None or self._conn.complete

    @property
    def extra_data(self) -> bool:
        """The upstream sent bytes after this response (dropped; the connection is closed)."""
        k = self._kept
        return self._conn.extra_data if k is None else k.extra_data

    @property
    def request_abandoned(self) -> bool:
        """The upstream answered before the request body was all sent (an early answer)."""
        k = self._kept
        return self._conn.state.req is Req.ABANDONED if k is None else k.abandoned

    @property
    def buffered_bytes(self) -> int:
        k = self._kept
        return self._conn.buffered if k is None else len(k.body)

    def take_body(self) -> bytes:
        """All of the body, when ``complete``."""
        assert self.complete
        k = self._kept
        if k is not None:
            body, k.body = k.body, b""
            return body
        body = b"".join(self._conn.body)
        self._conn.body.clear()
        return body

    async def read_chunk(self, idle_timeout: float) -> bytes:
        if self._kept is not None:
            return self.take_body()  # all of it, then b"": the end
        return await self._conn.read_chunk(idle_timeout)

    def detach_answer(self, limit: int) -> bool:
        """Keep this answer without its connection: when the whole of it has arrived, with at
        most ``limit`` body bytes, the body is copied out and the connection given back to the
        pool (kept if its exchange ended cleanly), so the answer can still be relayed later
        while it holds nothing but its bytes. False, and nothing done, for an answer still
        arriving, a larger one, or one already let go."""
        c = self._conn
        if self._done or not c.complete or c.buffered > limit:
            return False
        self._kept = _Kept(
            c.content_length,
            self.has_body,
            c.extra_data,
            c.state.req is Req.ABANDONED,
            b"".join(c.body),
        )
        c.body.clear()
        self._done = True
        self._pool.release(c)
        return True

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._pool.release(self._conn)

    def detach(self) -> tuple[asyncio.Transport | None, bytes]:
        """After a 101 that was asked for: the connection leaves the pool (its slot is freed,
        nothing closes it) and is handed over with the new protocol's bytes read so far. The
        transport is None when the upstream had already closed it."""
        conn = self._conn
        assert conn.tunnel_bytes is not None and not self._done
        self._done = True
        self._pool.detach(conn)
        tail = bytes(conn.tunnel_bytes)
        conn.tunnel_bytes = None
        return (None if conn.closed else conn.transport), tail

    def discard(self) -> None:
        """Drop the response: the connection is kept only if the body already ended."""
        if not self._done:
            self._done = True
            if not self._conn.complete:
                self._conn.abort()
            self._pool.release(self._conn)


class H2Response(UpstreamResponse):
    """An HTTP/2 upstream's response: one stream of a shared connection (``h2pool``)."""

    __slots__ = ("_endpoint", "_ex", "_length")

    def __init__(self, ex: H2Exchange, endpoint: str) -> None:
        # The HTTP/1.1 connection's slots (_pool, _conn) stay unset: every method that reads
        # them is overridden here.
        self._ex = ex
        self._endpoint = endpoint
        self._done = False
        self._kept = None
        self.status = ex.status
        self.headers = ex.headers
        self.interim = ex.interim
        # The one pass over the fields an HTTP/1.1 head gets (h2 has refused the framing
        # fields already): the announced length and the two fields the engine reads.
        fields = read_fields(ex.headers)
        self._length = fields.content_length
        self.retry_after = fields.retry_after
        self.proxy_error = fields.proxy_error
        self.grpc_status = ex.grpc_status
        self.pushback = ex.pushback

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def trailers(self) -> list[tuple[bytes, bytes]] | None:
        return self._ex.trailers

    @property
    def content_length(self) -> int | None:
        return self._length

    @property
    def has_body(self) -> bool:
        return not (self._ex.head_only or self.status in (204, 304))

    @property
    def complete(self) -> bool:
        ex = self._ex
        return ex.ended and ex.error is None

    @property
    def extra_data(self) -> bool:
        return False

    @property
    def request_abandoned(self) -> bool:
        return self._ex.abandoned

    @property
    def buffered_bytes(self) -> int:
        return self._ex.buffered

    def take_body(self) -> bytes:
        return self._ex.take_body()

    async def read_chunk(self, idle_timeout: float) -> bytes:
        return await self._ex.read_chunk(idle_timeout)

    def detach_answer(self, limit: int) -> bool:
        """Its body is in memory already when complete: nothing to copy, the stream is given
        back (a stream holds no connection of its own)."""
        ex = self._ex
        if self._done or not self.complete or ex.buffered > limit:
            return False
        self._done = True
        ex.finish()
        return True

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._ex.finish()

    def detach(self) -> tuple[asyncio.Transport | None, bytes]:
        raise AssertionError("an HTTP/2 stream is never switched to another protocol")

    def discard(self) -> None:
        if not self._done:
            self._done = True
            self._ex.cancel()


PoolKey = tuple[str, int, TlsTarget | None]


class UpstreamClient:
    def __init__(
        self, settings: PoolSettings | None = None, tls: TlsContexts | None = None
    ) -> None:
        self.settings = settings or PoolSettings()
        # The client contexts of https:// upstreams, by the route's tls: value (``sync_tls``).
        self.tls = tls or TlsContexts()
        # A pool per endpoint, and per TLS identity for an https:// one.
        self._pools: dict[PoolKey, Pool] = {}
        # HTTP/2 pools likewise, by the ALPN protocols they offer too.
        self._h2: dict[tuple[str, int, TlsTarget | None, bool], H2Pool] = {}
        # The endpoints of ``auto`` routes that chose HTTP/1.1 by ALPN.
        self._speaks_http1: set[PoolKey] = set()

    def pool(self, host: str, port: int, tls: TlsTarget | None = None) -> Pool:
        key = (host, port, tls)
        p = self._pools.get(key)
        if p is None:
            p = Pool(asyncio.get_running_loop(), host, port, self.settings, tls)
            self._pools[key] = p
        return p

    def h2_pool(self, host: str, port: int, tls: TlsTarget | None, auto: bool) -> H2Pool:
        key = (host, port, tls, auto)
        p = self._h2.get(key)
        if p is None:
            alpn = ("h2", "http/1.1") if auto else ("h2",)
            p = H2Pool(asyncio.get_running_loop(), host, port, self.settings, tls, alpn)
            self._h2[key] = p
        return p

    def stats(self) -> dict[str, PoolStats]:
        out = {
            f"{h}:{p}" if t is None else f"{h}:{p} tls {t.server_name}": pool.stats()
            for (h, p, t), pool in self._pools.items()
        }
        for (h, p, t, _), h2 in self._h2.items():
            total, idle = h2.stats()
            name = f"{h}:{p} h2" if t is None else f"{h}:{p} h2 tls {t.server_name}"
            out[name] = PoolStats(total, idle, 0)
        return out

    def sync_tls(self, sections: list[RouteTls]) -> None:
        """The contexts of a config being applied: new ones built (raises on a file gone bad:
        nothing changed), the pools of contexts no route uses any more closed (their busy
        connections close when given back)."""
        gone = set(self.tls.sync(sections))
        for key, pool in list(self._pools.items()):
            t = key[2]
            if t is not None and t.context in gone:
                pool.close()
                del self._pools[key]
        for hkey, h2 in list(self._h2.items()):
            t = hkey[2]
            if t is not None and t.context in gone:
                h2.close()
                del self._h2[hkey]

    async def request(
        self,
        host: str,
        port: int,
        head: bytes,
        body: Body,
        timeout: float,
        head_only: bool = False,
        *,
        chunked: bool = False,
        time_left: Callable[[], float] | None = None,
        upgrade: bool = False,
        tls: TlsTarget | None = None,
        protocol: str = "http1",
        grpc: bool = False,
    ) -> UpstreamResponse:
        """Send ``head`` (request line and headers, ending in a blank line) and ``body``.

        ``timeout`` bounds connecting plus waiting for the response head; for a streamed body
        the head wait starts once the body is sent (an upload may take longer than a per-try
        timeout), bounded by ``time_left()``, called at that moment (the sequence deadline,
        which starts again there), and the upstream must keep taking body bytes within
        ``timeout``. An upstream that answers before the body is all sent gets no more of it:
        its answer is returned and the connection is not reused. The request is sent once: a
        failure is raised as an UpstreamError for the retry engine to judge, never resent here.
        ``upgrade``: the request asks for a protocol switch, and a 101 is an answer to it.
        ``tls``: an https:// endpoint, spoken to over TLS with that identity (the handshake
        is part of connecting: its refusal is raised as a TLS error, nothing sent).
        ``protocol``: the route's ``upstream_protocol`` (``h2``: one stream of a shared
        HTTP/2 connection; ``auto``: HTTP/2 when an https:// upstream chooses it by ALPN).
        ``grpc``: a gRPC call (its status is read before the answer is committed).
        """
        if protocol != "http1" and not upgrade:
            auto = protocol == "auto"
            if not auto or (tls is not None and (host, port, tls) not in self._speaks_http1):
                h2 = self.h2_pool(host, port, tls, auto)
                try:
                    ex = await h2.request(head, body, timeout, head_only, grpc)
                except SpeaksHttp1:
                    self._speaks_http1.add((host, port, tls))
                else:
                    return H2Response(ex, h2.endpoint)
        pool = self.pool(host, port, tls)
        # The pool's loop: asyncio.get_running_loop() costs a getpid() system call per call
        # on Python 3.11.
        loop = pool.loop
        started = loop.time()
        conn = await pool.acquire(timeout)
        if loop.time() - started >= timeout:
            # The wait for a connection used the attempt's time up: write nothing upstream.
            pool.release(conn)
            raise NoTimeLeft("no time left to send the request")
        try:
            conn.begin(head_only, upgrade)
            if body is None or isinstance(body, bytes):
                conn.write(head + body if body else head)
                conn.request_sent()
                head_wait = timeout - (loop.time() - started)
            else:
                conn.write(head)
                if await send_stream(conn, body, chunked, timeout):
                    conn.request_sent()
                else:
                    conn.abandon_request()  # answered early: relay that answer, send no more
                head_wait = timeout if time_left is None else min(timeout, time_left())
            await conn.wait_head(head_wait)
        except UpstreamError:
            conn.abort()
            pool.release(conn)
            raise
        except OSError as exc:
            conn.abort()
            pool.release(conn)
            raise UpstreamReset(f"sending to upstream failed: {exc}") from None
        except BaseException:
            conn.abort()
            pool.release(conn)
            raise
        return UpstreamResponse(pool, conn)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        for h2 in self._h2.values():
            h2.close()


__all__ = ["ConnectFailure", "UpstreamClient", "UpstreamResponse"]

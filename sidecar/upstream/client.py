"""Send one request upstream, exactly once, and hand back a streaming response."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

from sidecar.config.tls import RouteTls
from sidecar.core import ConnectFailure, NoTimeLeft, UpstreamError, UpstreamReset
from sidecar.upstream.connection import Connection
from sidecar.upstream.pool import Pool, PoolSettings, PoolStats
from sidecar.upstream.states import Req
from sidecar.upstream.tls import TlsContexts, TlsTarget
from sidecar.upstream.upload import send_stream

Headers = list[tuple[bytes, bytes]]
Body = bytes | AsyncIterator[bytes] | None


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
        "headers",
        "interim",
        "proxy_error",
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

    def pool(self, host: str, port: int, tls: TlsTarget | None = None) -> Pool:
        key = (host, port, tls)
        p = self._pools.get(key)
        if p is None:
            p = Pool(asyncio.get_running_loop(), host, port, self.settings, tls)
            self._pools[key] = p
        return p

    def stats(self) -> dict[str, PoolStats]:
        return {
            f"{h}:{p}" if t is None else f"{h}:{p} tls {t.server_name}": pool.stats()
            for (h, p, t), pool in self._pools.items()
        }

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
        """
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


__all__ = ["ConnectFailure", "UpstreamClient", "UpstreamResponse"]

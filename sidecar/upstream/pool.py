"""A bounded keep-alive pool of upstream connections for one (host, port), and for an
``https://`` endpoint one TLS identity (the route's context and the server name: ``tls.TlsTarget``).

``max_connections`` bounds idle + busy + connecting connections. When all are busy a caller
waits at most ``wait_timeout`` (separate from the connect timeout) and then gets PoolExhausted.
Idle connections are reused newest first and closed after ``idle_timeout``.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections import deque
from dataclasses import dataclass

from sidecar import outcomes
from sidecar.config.model import UpstreamPool
from sidecar.core import ConnectFailure, NoTimeLeft, PoolExhausted, connect_error_type
from sidecar.upstream.connection import Connection
from sidecar.upstream.tls import OK, TlsTarget, handshake_error

# The pool's settings are the config's ``upstream_pool`` section itself.
PoolSettings = UpstreamPool


@dataclass(frozen=True, slots=True)
class PoolStats:
    total: int
    idle: int
    waiting: int


# What a queued caller is handed: a connection, or the right to open one (a reserved slot).
Grant = Connection | None


class Pool:
    """Ownership: a connection is owned by exactly one of the idle list, a caller (from
    ``acquire`` until ``release``), or a queued caller's grant. Queued callers are served first
    come, first served: a released connection or a freed slot is handed to the head of the
    queue directly, never left for a newcomer to take; a caller cancelled after it was handed
    one gives it back (to the next in the queue, or the idle list); a caller handed a
    connection that went bad before it ran closes it and connects in its slot."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        host: str,
        port: int,
        settings: PoolSettings,
        tls: TlsTarget | None = None,
    ) -> None:
        self._loop = loop
        self.loop = loop  # read by the client on every request (no get_running_loop call)
        self.host = host
        self.port = port
        self.endpoint = f"{host}:{port}"  # the access log's upstream
        self.tls = tls  # an https:// endpoint: the TLS identity its connections have
        self.settings = settings
        self._idle: list[Connection] = []
        self._total = 0  # idle + busy + connecting + granted
        self._waiters: deque[asyncio.Future[Grant]] = deque()
        self._closed = False

    def stats(self) -> PoolStats:
        return PoolStats(self._total, len(self._idle), len(self._waiters))

    async def acquire(self, connect_timeout: float) -> Connection:
        """An idle pooled connection (newest first), or a new one. ``connect_timeout`` is
        what is left of the attempt: it bounds the wait for a connection and the connect."""
        if self._closed:
            raise ConnectFailure("the upstream client is shut down")
        if not self._waiters:  # nobody queued: no one to overtake
            conn = self._take_idle()
            if conn is not None:
                return conn
            if self._total < self.settings.max_connections:
                self._total += 1
                return await self._connect_reserved(connect_timeout)
        # The wait for a free connection is part of the attempt's time: bounded by it (and
        # so by the sequence deadline) as well as by wait_timeout.
        deadline = self._loop.time() + connect_timeout
        wait = self.settings.wait_timeout
        grant = await self._wait(min(wait, connect_timeout), connect_timeout < wait)
        if grant is not None:
            if grant.usable():
                return grant
            # It went bad between the hand-off and this caller's turn (the loop delivered
            # stray bytes or the upstream's FIN first): drop it and connect in its slot, as
            # _take_idle does with a stale idle connection.
            grant.close()
        return await self._connect_reserved(deadline - self._loop.time())

    def _take_idle(self) -> Connection | None:
        while self._idle:
            conn = self._idle.pop()
            if conn.idle_handle is not None:
                conn.idle_handle.cancel()
                conn.idle_handle = None
            if conn.usable():
                return conn
            self._total -= 1  # closed while idle: its slot is free (the caller may use it)
        return None

    async def _connect_reserved(self, timeout: float) -> Connection:
        """Connect in a slot already counted in ``_total``; the slot is freed on failure."""
        try:
            return await self._connect(timeout)
        except BaseException:
            self._total -= 1
            self._grant_next()
            raise

    async def _wait(self, wait: float, attempt_bound: bool) -> Connection | None:
        """Queue for a grant, at most ``wait`` seconds; ``attempt_bound``: the attempt's own
        time (its per-try timeout or the sequence deadline), not ``wait_timeout``, ends it."""
        fut: asyncio.Future[Grant] = self._loop.create_future()
        self._waiters.append(fut)
        handle = self._loop.call_later(max(wait, 0.0), _expire, fut, attempt_bound)
        try:
            return await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Handed a grant, then cancelled before it could be used (same loop turn):
                # give it back, or it is lost with this caller.
                grant = fut.result()
                if grant is None:
                    self._total -= 1
                    self._grant_next()
                else:
                    self.release(grant)
            raise
        finally:
            handle.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)

    def _next_waiter(self) -> asyncio.Future[Grant] | None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                return fut
        return None

    def _grant_next(self) -> None:
        """A slot may have freed: hand an idle connection or a slot to the head waiter."""
        while self._waiters:
            conn = self._take_idle()
            if conn is None and self._total >= self.settings.max_connections:
                return
            fut = self._next_waiter()
            if fut is None:
                if conn is not None:
                    self._park(conn)
                return
            if conn is None:
                self._total += 1  # reserved for the waiter, which connects
            fut.set_result(conn)

    async def _connect(self, timeout: float) -> Connection:
        timeout = min(timeout, self.settings.connect_timeout)
        if timeout <= 0:
            raise NoTimeLeft("no time left to connect")  # nothing was sent: not a failure
        tls = self.tls
        if tls is not None:
            return await self._connect_tls(tls, timeout)
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self._loop.create_connection(
                    lambda: Connection(self._loop, (self.host, self.port)), self.host, self.port
                )
        except TimeoutError:
            raise ConnectFailure(
                f"connect to {self.host}:{self.port} timed out", "connection_timeout"
            ) from None
        except (OSError, socket.gaierror) as exc:
            raise ConnectFailure(
                f"connect to {self.host}:{self.port} failed: {exc}", connect_error_type(exc)
            ) from None
        return conn

    async def _connect_tls(self, tls: TlsTarget, timeout: float) -> Connection:
        """Connect and handshake, both within ``timeout``; SNI and the name verified are the
        target's name, never the address connected to. Each handshake is counted by result."""
        where = f"{tls.server_name} ({self.host}:{self.port})"
        try:
            async with asyncio.timeout(timeout):
                _, conn = await self._loop.create_connection(
                    lambda: Connection(self._loop, (self.host, self.port), tls),
                    self.host,
                    self.port,
                    ssl=tls.ssl,
                    server_hostname=tls.server_name,
                    ssl_handshake_timeout=timeout,
                )
        except TimeoutError:
            tls.report(outcomes.CONNECT_FAILURE.name)
            raise ConnectFailure(f"connect to {where} timed out", "connection_timeout") from None
        except (OSError, socket.gaierror) as exc:
            refused = handshake_error(exc, where) if isinstance(exc, ssl.SSLError) else None
            if refused is not None:
                tls.report(refused.code, refused)
                raise refused from None
            tls.report(outcomes.CONNECT_FAILURE.name)
            raise ConnectFailure(
                f"connect to {where} failed: {exc!r}", connect_error_type(exc)
            ) from None
        tls.report(OK)
        return conn

    def release(self, conn: Connection) -> None:
        """Give a connection back: kept if its exchange ended cleanly (handed straight to the
        head waiter, else idle), else closed and its slot handed on."""
        tls = conn.tls
        if tls is not None and conn.session_pending and conn.transport is not None:
            # After its first exchange: a TLS 1.3 server's ticket has come by now.
            conn.session_pending = False
            tls.keep_session(conn.transport.get_extra_info("ssl_object"))
        if not self._closed and conn.reusable():
            fut = self._next_waiter()
            if fut is not None:
                fut.set_result(conn)
            else:
                self._park(conn)
            return
        conn.abort() if not conn.complete else conn.close()
        self._total -= 1
        self._grant_next()

    def detach(self, conn: Connection) -> None:
        """A caller keeps ``conn`` for good (a tunnel after a 101): its slot is freed, the
        connection is the caller's to close."""
        self._total -= 1
        self._grant_next()

    def _park(self, conn: Connection) -> None:
        conn.idle_handle = self._loop.call_later(
            self.settings.idle_timeout, self._expire_idle, conn
        )
        self._idle.append(conn)

    def _expire_idle(self, conn: Connection) -> None:
        conn.idle_handle = None
        if conn in self._idle:
            self._idle.remove(conn)
            conn.close()
            self._total -= 1
            self._grant_next()

    def close(self) -> None:
        self._closed = True
        for conn in self._idle:
            if conn.idle_handle is not None:
                conn.idle_handle.cancel()
            conn.close()
            self._total -= 1
        self._idle.clear()
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_exception(ConnectFailure("the upstream client is shut down"))


def _expire(fut: asyncio.Future[Grant], attempt_bound: bool) -> None:
    if fut.done():
        return
    if attempt_bound:
        # The attempt's time ran out before a connection freed up: nothing was sent, as when
        # it runs out before connecting (a deadline, not the pool staying full for its wait).
        fut.set_exception(NoTimeLeft("no time left waiting for a connection"))
    else:
        fut.set_exception(PoolExhausted("every upstream connection stayed busy"))

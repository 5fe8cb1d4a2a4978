"""A bounded keep-alive pool of upstream connections for one (host, port).

``max_connections`` bounds idle + busy + connecting connections. When all are busy a caller
waits at most ``wait_timeout`` (separate from the connect timeout) and then gets PoolExhausted.
Idle connections are reused newest first and closed after ``idle_timeout``.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from dataclasses import dataclass

from sidecar.config.model import UpstreamPool
from sidecar.core import ConnectFailure, NoTimeLeft, PoolExhausted, connect_error_type
from sidecar.upstream.connection import Connection

# The pool's settings are the config's ``upstream_pool`` section itself.
PoolSettings = UpstreamPool


@dataclass(frozen=True, slots=True)
class PoolStats:
    total: int
    idle: int
    waiting: int


class Pool:
    def __init__(
        self, loop: asyncio.AbstractEventLoop, host: str, port: int, settings: PoolSettings
    ) -> None:
        self._loop = loop
        self.host = host
        self.port = port
        self.settings = settings
        self._idle: list[Connection] = []
        self._total = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._closed = False

    def stats(self) -> PoolStats:
        return PoolStats(self._total, len(self._idle), len(self._waiters))

    async def acquire(self, connect_timeout: float) -> Connection:
        """An idle pooled connection (newest first), or a new one. ``connect_timeout`` is
        what is left of the attempt: it bounds the wait for a connection and the connect."""
        while True:
            while self._idle:
                conn = self._idle.pop()
                if conn.idle_handle is not None:
                    conn.idle_handle.cancel()
                    conn.idle_handle = None
                if conn.usable():
                    return conn
                self._forget(conn)
            if self._closed:
                raise ConnectFailure("the upstream client is shut down")
            if self._total < self.settings.max_connections:
                self._total += 1
                try:
                    return await self._connect(connect_timeout)
                except BaseException:
                    self._total -= 1
                    self._wake_one()
                    raise
            # The wait for a free connection is part of the attempt's time: bounded by it
            # (and so by the sequence deadline) as well as by wait_timeout.
            deadline = self._loop.time() + connect_timeout
            await self._wait_for_slot(min(self.settings.wait_timeout, connect_timeout))
            connect_timeout = deadline - self._loop.time()

    async def _wait_for_slot(self, wait: float) -> None:
        fut: asyncio.Future[None] = self._loop.create_future()
        self._waiters.append(fut)
        handle = self._loop.call_later(max(wait, 0.0), _expire, fut)
        try:
            await fut
        except BaseException:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                # Woken by a release, then cancelled before this waiter could use the
                # wake-up (same loop turn): hand it on, or the next waiter sleeps until
                # its own timeout while a connection is free.
                self._wake_one()
            raise
        finally:
            handle.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)

    async def _connect(self, timeout: float) -> Connection:
        timeout = min(timeout, self.settings.connect_timeout)
        if timeout <= 0:
            raise NoTimeLeft("no time left to connect")  # nothing was sent: not a failure
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

    def release(self, conn: Connection) -> None:
        """Give a connection back: kept if its exchange ended cleanly, else closed."""
        if not self._closed and conn.reusable():
            conn.idle_handle = self._loop.call_later(
                self.settings.idle_timeout, self._expire_idle, conn
            )
            self._idle.append(conn)
            self._wake_one()
            return
        conn.abort() if not conn.complete else conn.close()
        self._forget(conn)

    def _forget(self, conn: Connection) -> None:
        self._total -= 1
        self._wake_one()

    def _expire_idle(self, conn: Connection) -> None:
        conn.idle_handle = None
        if conn in self._idle:
            self._idle.remove(conn)
            conn.close()
            self._forget(conn)

    def _wake_one(self) -> None:
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return

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


def _expire(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_exception(PoolExhausted("every upstream connection stayed busy"))

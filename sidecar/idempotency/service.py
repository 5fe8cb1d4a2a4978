"""The idempotency store of a running process: opened when a route first enables idempotency (at
start, or on the reload that enables it), tried again with a backoff while it cannot be opened
(guarded writes get their route's ``on_store_error`` meanwhile), closed at stop. The backend is
the one the process started with (``idempotency.backend`` is restart-only): the SQLite file at
``idempotency.path``, or the fleet's Redis (``redis``: opening makes the client and no
connection; an unreachable Redis is a ``StoreError`` per call, so it never needs reopening; its
``maxmemory-policy`` is checked once it answers, ``check_redis``, shown as ``warning``).

The opening runs in a worker thread. A stop that comes during it closes the store it was opening:
``SqliteIdempotencyStore.close`` marks it closed, and an ``open`` still running closes the
connections it opened itself, in its thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from sidecar.config.fleet import FleetRedis
from sidecar.config.model import Config
from sidecar.core import Clock
from sidecar.fleet.links import FleetLinks
from sidecar.idempotency.holding import Holdings
from sidecar.idempotency.store import IdempotencyStore

if TYPE_CHECKING:
    from sidecar.fleet.connection import FleetLink

    # sqlite3 (or redis) is loaded when a route first enables idempotency, never without.
    from sidecar.idempotency.sqlite import SqliteIdempotencyStore

log = logging.getLogger("sidecar.idempotency")

REOPEN_FIRST = 1.0  # seconds before the second try; doubled each time up to REOPEN_MAX
REOPEN_MAX = 60.0
FLEET_USE = "idempotency"  # the Redis backend's link, as the fleet view names it
CHECK_AGAIN = 5.0  # seconds before the start-up check of the Redis asks again


def wanted(config: Config) -> bool:
    return any(r.idempotency.enabled for r in config.routes)


def reopen_delay(failures: int) -> float:
    """The pause after ``failures`` failed openings (1, 2, 4 ... 60 s). Pure."""
    return float(min(REOPEN_MAX, REOPEN_FIRST * 2 ** max(0, failures - 1)))


def _in_thread(store: SqliteIdempotencyStore) -> Callable[[], Awaitable[None]]:
    """No more calls from now (``detach``, on the loop), then the final checkpoint and the
    file's closing in a worker thread."""

    async def close() -> None:
        store.detach()
        await asyncio.to_thread(store.close)

    return close


class KeyStoreService:
    def __init__(
        self,
        config: Config,
        clock: Clock,
        on_open: Callable[[IdempotencyStore], None],
        links: FleetLinks,
    ) -> None:
        # What the process started with (``backend``, ``path`` and ``fleet`` are restart-only).
        self.path = config.idempotency.path
        self.backend = config.idempotency.backend
        self._max = (config.idempotency.max_records, config.idempotency.max_bytes)
        self._redis: FleetRedis = config.fleet.redis
        self._clock = clock
        self._on_open = on_open
        self._links = links  # the Redis backend's link is shown there
        self.store: IdempotencyStore | None = None
        # The keys this process holds and the settlements it retries: stopped before the close.
        self.holdings = Holdings(clock)
        self._closing: Callable[[], Awaitable[None]] | None = None  # the open store's close
        self._lock = asyncio.Lock()
        self._link: FleetLink | None = None  # the Redis backend's
        # What the start-up check of the fleet's Redis found (it may evict keys), or None.
        self.warning: str | None = None

    async def open(self, draining: Callable[[], bool]) -> bool:
        """One try; False when the file could not be opened now."""
        async with self._lock:
            if self.store is not None:
                return True
            if self.backend == "redis":
                await self._open_redis().open_connections()
                return True
            import sqlite3

            from sidecar.idempotency.sqlite import Bounds, SqliteIdempotencyStore

            bounds = Bounds(*self._max)
            store = SqliteIdempotencyStore(self.path, self._clock, bounds=bounds)
            opening = asyncio.ensure_future(asyncio.to_thread(store.open))
            try:
                await asyncio.shield(opening)
            except asyncio.CancelledError:
                store.close()  # the thread stops what it opens after this, if it still runs
                raise
            except (OSError, sqlite3.Error) as exc:
                log.error("cannot open the idempotency store at %s: %s", self.path, exc)
                return False
            if draining():
                await asyncio.to_thread(store.close)
                return True
            self.store = store
            self._closing = _in_thread(store)
            self._on_open(store)
            log.info("idempotency store open at %s", self.path)
            return True

    def _open_redis(self) -> FleetLink:
        from sidecar.fleet.connection import FleetLink
        from sidecar.idempotency.redisstore import RedisIdempotencyStore

        link = self._link = FleetLink(self._redis, self._clock, use=FLEET_USE)
        self._links.add(link, "guarded writes get their route's on_store_error")
        store = RedisIdempotencyStore(link, self._clock)
        self.store, self._closing = store, store.close
        self._on_open(store)
        log.info("idempotency keys kept in the fleet Redis (%s)", self._redis.url)
        return link

    async def check_redis(self) -> None:
        """The start-up check that the fleet's Redis will not evict keys (``fleet.eviction``),
        asked until it answers once; what it finds is ``warning`` and a log line."""
        from sidecar.fleet.connection import FleetUnavailable
        from sidecar.fleet.eviction import check

        assert self._link is not None
        while True:
            try:
                self.warning = await check(self._link, FLEET_USE)
            except FleetUnavailable as exc:
                log.warning("cannot check the fleet Redis's maxmemory-policy yet: %s", exc)
                await asyncio.sleep(CHECK_AGAIN)
                continue
            if self.warning is not None:
                log.warning("idempotency keys on Redis: %s", self.warning)
            return

    async def keep_opening(self, draining: Callable[[], bool]) -> None:
        """Open, trying again with a backoff while the file cannot be opened."""
        failures = 0
        while not draining() and not await self.open(draining):
            failures += 1
            delay = reopen_delay(failures)
            log.warning(
                "the idempotency store at %s stays unavailable; opening it again in %.0fs",
                self.path,
                delay,
            )
            await asyncio.sleep(delay)

    async def close(self) -> None:
        """The settlements still retried cancelled (their keys left to their lease), then the
        store closed."""
        await self.holdings.stop()
        closing, self._closing = self._closing, None
        self.store = None
        if closing is not None:
            await closing()

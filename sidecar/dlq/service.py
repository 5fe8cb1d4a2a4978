"""The DLQ of a running process: its store opened (at start, or by the first reload that
enables a DLQ route), its replayer, redrive and background work started, and all of it closed
at stop. The backend is the one the process started with (``dlq.backend`` and ``dlq.path`` are
restart-only), chosen here and nowhere else:

- ``sqlite``: the file at ``dlq.path``, opened in a worker thread (which closes what it opened
  when a stop came meanwhile: ``opening``), tried again with a backoff while it cannot be opened
  (``reopen``); writes are ``unavailable`` meanwhile.
- ``redis``: the fleet's Redis (``redisstore``). Opening makes a client and no connection; an
  unreachable Redis is ``DlqUnavailable`` per call, so it never needs reopening. Its start-up
  checks (``fleet.aof``: ``appendonly``/``appendfsync``; ``fleet.eviction``: ``maxmemory-policy``)
  run in the ``dlq-redis-check`` task,
  asked again until the Redis answers; the gauges' counts are read by ``dlq-counts``, which
  also checks that the Redis still holds the DLQ's data (``redisepoch``: a loss is counted in
  the same counter as a deleted SQLite file, and shown as the DLQ warning).

The tasks are the app's (``spawn``: named, cancelled and awaited at stop); the store is closed
by ``close`` after them: the SQLite writer thread once it committed what it was given, the
Redis client once the claim releases in flight finished.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from sidecar.config.model import Config
from sidecar.dlq.opening import Opening, close_opened, on_loop
from sidecar.dlq.reopen import reopen_delay
from sidecar.engine.deps import EngineDeps
from sidecar.fleet.links import FleetLinks

if TYPE_CHECKING:
    # The stores, the replayer and the redrive (and sqlite3 or redis with them) are imported
    # when a DLQ opens, not at start: a sidecar with no DLQ route never loads them.
    from sidecar.dlq.contract import DlqStorage
    from sidecar.dlq.redisstore import RedisDlqStore
    from sidecar.dlq.redrive import Redrive
    from sidecar.dlq.replay import Replayer
    from sidecar.dlq.store import DlqStore

log = logging.getLogger("sidecar.dlq")

Spawn = Callable[[str, Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]
COUNTS_EVERY = 2.0  # seconds between reads of the fleet-wide counts for the gauges
CHECK_AGAIN = 5.0  # seconds before the start-up check asks an unreachable Redis again
FLEET_USE = "dlq"  # the Redis backend's link, as the fleet view names it


class DlqService:
    def __init__(
        self,
        config: Config,
        engine: EngineDeps,
        current: Callable[[], Config],
        *,
        spawn: Spawn,
        on_open: Callable[[DlqStorage], None],
        recreated: Callable[[], None],
        links: FleetLinks,
    ) -> None:
        # What the process started with (restart-only), even when a reload opens it.
        self.backend = config.dlq.backend
        self.path = config.dlq.path
        self._redis = config.fleet.redis
        self._engine = engine
        self._current = current
        self._spawn = spawn
        self._on_open = on_open
        self._recreated = recreated
        self._links = links  # the Redis backend's link is shown there
        self.store: DlqStorage | None = None
        self.replayer: Replayer | None = None
        self.redrive: Redrive | None = None
        self.durability: str | None = None  # what the start-up check found wrong
        self._lost: Callable[[], str | None] = lambda: None  # the Redis lost the DLQ's data
        self.queue_depth: Callable[[], int] | None = None  # the SQLite writer's queue
        self.max_page_count: int | None = None  # tests: a real SQLITE_FULL
        self.busy_timeout_ms = 5000  # tests: a lock held elsewhere fails sooner
        self._opening: asyncio.Lock | None = None  # made at start, on the loop
        self._reopening: asyncio.Task[Any] | None = None
        self._closing: Callable[[], Awaitable[None]] | None = None  # the open store's close

    @property
    def warning(self) -> str | None:
        """The status page's DLQ warning: a Redis found to have lost the DLQ's data (until a
        restart), and what the start-up check found wrong."""
        said = [w for w in (self._lost(), self.durability) if w]
        return "; ".join(said) or None

    @property
    def started(self) -> bool:
        return self._opening is not None

    def wanted(self, config: Config) -> bool:
        """Opened only when a route uses it or (SQLite) its file already exists: nothing is
        written outside the paths the config names, and nothing at all when unused."""
        if any(r.dlq.enabled for r in config.routes):
            return True
        return self.backend == "sqlite" and os.path.exists(self.path)

    def location(self) -> str:
        return self.store.location if self.store is not None else self._where()

    def _where(self) -> str:
        return self.path if self.backend == "sqlite" else f"{self._redis.url}"

    def opened(self) -> tuple[DlqStorage, Replayer] | None:
        if self.store is None or self.replayer is None:
            return None
        return self.store, self.replayer

    async def start(self) -> None:
        self._opening = asyncio.Lock()
        if self.wanted(self._current()) and not await self.open_now():
            self._keep_opening()

    def applied(self, config: Config) -> None:
        """A reload: the bounds apply to the next record; the first reload that enables a
        DLQ route (after the start) opens it."""
        if self.store is not None:
            self.store.set_limits(config.dlq.max_records, config.dlq.max_bytes)
        elif any(r.dlq.enabled for r in config.routes) and self._opening is not None:
            self._keep_opening()

    def _keep_opening(self) -> None:
        if self._reopening is None or self._reopening.done():
            self._reopening = self._spawn("dlq-open", self.keep_opening())

    # -- opening -----------------------------------------------------------------------------

    def open_sqlite(self, config: Config) -> DlqStore | None:
        """In a worker thread: open (check, create, migrate) the DLQ file. The first call
        imports the store and sqlite3, off the event loop."""
        import sqlite3

        from sidecar.dlq.store import DlqStore

        store = DlqStore(
            self.path,
            config.dlq.max_records,
            config.dlq.max_bytes,
            max_page_count=self.max_page_count,
            busy_timeout_ms=self.busy_timeout_ms,
        )
        try:
            store.open()
        except (OSError, sqlite3.Error) as exc:
            # The proxy keeps serving; failed writes get x-retry-dlq: unavailable.
            log.error("cannot open the DLQ at %s: %s", self.path, exc)
            return None
        return store

    async def _opened_sqlite(self, config: Config) -> DlqStore | None:
        opener = Opening(lambda: self.open_sqlite(config))
        opening = asyncio.ensure_future(asyncio.to_thread(opener))
        try:
            store = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # Shut down while the thread opens it: whatever it opens is closed again, by the
            # thread itself unless it had already handed the store over.
            if opener.abandon():
                opening.add_done_callback(close_opened)
            raise
        if store is not None:
            store.on_recreated = on_loop(asyncio.get_running_loop(), self._recreated)
            self.queue_depth = store.queue_depth
        return store

    def _opened_redis(self, config: Config) -> RedisDlqStore:
        from sidecar.dlq.redisstore import RedisDlqStore
        from sidecar.fleet.connection import FleetLink

        link = FleetLink(self._redis, self._engine.clock, use=FLEET_USE)
        self._links.add(link, "writes get x-retry-dlq: unavailable; records are not redriven")
        store = RedisDlqStore(
            link, config.dlq.max_records, config.dlq.max_bytes, location=self._where()
        )
        store.epoch.on_lost = self._recreated  # the same counter as a deleted file
        self._lost = lambda: store.epoch.note
        return store

    async def open_now(self) -> bool:
        """Open the DLQ and start its background work. False when the file could not be
        opened now."""
        assert self._opening is not None
        async with self._opening:
            if self.store is not None:
                return True
            config = self._current()
            store: DlqStorage
            if self.backend == "redis":
                redis = self._opened_redis(config)
                store, self._closing = redis, redis.close
            else:
                sqlite = await self._opened_sqlite(config)
                if sqlite is None:
                    return False
                store, self._closing = sqlite, lambda: asyncio.to_thread(sqlite.close)
            if self._engine.life.draining:
                await self.close()
                return True
            self._started(store)
            log.info("DLQ open at %s", store.location)
            return True

    def _started(self, store: DlqStorage) -> None:
        from sidecar.dlq.redisstore import RedisDlqStore
        from sidecar.dlq.redrive import Redrive, prune
        from sidecar.dlq.replay import Replayer

        self.store = store
        self._on_open(store)
        self.replayer = Replayer(store, self._engine, self._current)
        self.redrive = Redrive(self.replayer, self._current, self._engine.life)
        self._spawn("dlq-redrive", self.redrive.run())
        self._spawn("dlq-prune", prune(store))
        if isinstance(store, RedisDlqStore):
            self._spawn("dlq-counts", _counts_forever(store))
            self._spawn("dlq-redis-check", self._check(store))

    async def keep_opening(self) -> None:
        """Open the DLQ, trying again (backing off) while it cannot be opened."""
        failures = 0
        life = self._engine.life
        while not life.draining and not await self.open_now():
            failures += 1
            delay = reopen_delay(failures)
            log.warning(
                "the DLQ at %s stays unavailable; opening it again in %.0fs (try %d)",
                self.path,
                delay,
                failures,
            )
            await asyncio.sleep(delay)

    async def _check(self, store: RedisDlqStore) -> None:
        """The start-up check of the Redis's durability, asked until it answers once."""
        from sidecar.fleet import eviction
        from sidecar.fleet.aof import check
        from sidecar.fleet.connection import FleetUnavailable

        while True:
            try:
                said = [await check(store.link), await eviction.check(store.link, "dlq")]
                self.durability = "; ".join(w for w in said if w) or None
            except FleetUnavailable as exc:
                log.warning("cannot check the fleet Redis's durability yet: %s", exc)
                await asyncio.sleep(CHECK_AGAIN)
                continue
            if self.durability is not None:
                log.warning("DLQ on Redis: %s", self.durability)
            return

    async def close(self) -> None:
        """After the tasks were stopped: the store closed, its connections with it."""
        closing, self._closing = self._closing, None
        self.store, self.replayer = None, None
        if closing is not None:
            await closing()


async def _counts_forever(store: RedisDlqStore) -> None:
    """The gauges read what this last published: a scrape never waits on Redis."""
    from sidecar.dlq.errors import DlqUnavailable

    while True:
        # Unreachable: the gauges keep the last counts, and dlq_available says so.
        with contextlib.suppress(DlqUnavailable):
            await store.refresh()
        await asyncio.sleep(COUNTS_EVERY)

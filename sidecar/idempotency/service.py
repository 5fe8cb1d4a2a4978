"""The idempotency file of a running process: opened when a route first enables idempotency (at
start, or on the reload that enables it), tried again with a backoff while it cannot be opened
(guarded writes get their route's ``on_store_error`` meanwhile), closed at stop.

The opening runs in a worker thread. A stop that comes during it closes the store it was opening:
``SqliteIdempotencyStore.close`` marks it closed, and an ``open`` still running closes the
connections it opened itself, in its thread.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from sidecar.config.model import Config
from sidecar.core import Clock

if TYPE_CHECKING:
    # sqlite3 is loaded when a route first enables idempotency, never for a sidecar without.
    from sidecar.idempotency.sqlite import SqliteIdempotencyStore

log = logging.getLogger("sidecar.idempotency")

REOPEN_FIRST = 1.0  # seconds before the second try; doubled each time up to REOPEN_MAX
REOPEN_MAX = 60.0


def wanted(config: Config) -> bool:
    return any(r.idempotency.enabled for r in config.routes)


def reopen_delay(failures: int) -> float:
    """The pause after ``failures`` failed openings (1, 2, 4 ... 60 s). Pure."""
    return float(min(REOPEN_MAX, REOPEN_FIRST * 2 ** max(0, failures - 1)))


class KeyStoreService:
    def __init__(
        self,
        path: str,
        clock: Clock,
        on_open: Callable[[SqliteIdempotencyStore], None],
    ) -> None:
        self.path = path  # the file the process started with (``path`` is restart-only)
        self._clock = clock
        self._on_open = on_open
        self.store: SqliteIdempotencyStore | None = None
        self._lock = asyncio.Lock()

    async def open(self, draining: Callable[[], bool]) -> bool:
        """One try; False when the file could not be opened now."""
        async with self._lock:
            if self.store is not None:
                return True
            import sqlite3

            from sidecar.idempotency.sqlite import SqliteIdempotencyStore

            store = SqliteIdempotencyStore(self.path, self._clock)
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
            self._on_open(store)
            log.info("idempotency store open at %s", self.path)
            return True

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
        """No more calls from now (``detach``, on the loop), then the final checkpoint and the
        file's closing in a worker thread."""
        store, self.store = self.store, None
        if store is not None:
            store.detach()
            await asyncio.to_thread(store.close)

"""The DLQ's one writer thread: group commit, and a periodic refresh.

Operations are queued from the event loop and run in this thread, as many as are waiting in one
transaction (one fsync per group). Each runs under its own savepoint: a refusal (full, a claim
not granted) rolls back only itself. A storage error fails the whole group with
DlqUnavailable. Each operation's future is settled on its own loop once the group committed.
Between groups, and at least every ``refresh_every`` seconds, ``refresh`` runs in this thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.dlq.errors import REFUSALS, DlqUnavailable
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.dlq")

GROUP_MAX = 512
Delta = dict[str, int]  # what a group changed: "records", "bytes", "status:<s>" counts
Operation = Callable[[sqlite3.Connection, Delta], Any]


@dataclass
class _Op:
    fn: Operation
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


_REFRESH: Any = object()  # the wake-up for a periodic refresh


class GroupWriter:
    def __init__(
        self,
        conn: sqlite3.Connection,
        committed: Callable[[sqlite3.Connection, Delta], None],
        refresh: Callable[[sqlite3.Connection], None],
        refresh_every: Callable[[], float],
        verify: Callable[[sqlite3.Connection], sqlite3.Connection] = lambda conn: conn,
    ) -> None:
        self._conn = conn
        # After each commit and before each refresh: is the connection's file still the one
        # at the path? Gives the connection to go on with (a new one when the file was
        # recreated), or raises when nothing can be acknowledged.
        self._verify = verify
        self._committed = committed  # after a group committed a non-empty delta
        self._refresh = refresh
        self._refresh_every = refresh_every
        self._queue: queue.Queue[_Op | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        # A storage outage fails every group: one line per group would be one per failed
        # request. Limited as the proxy's own error lines are (used by this thread only).
        self._failures = RateLimit(per_interval=10, interval=60.0)

    @property
    def running(self) -> bool:
        return self._thread is not None

    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dlq-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Run what is queued, then end the thread (which closes the connection)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def submit(self, fn: Operation) -> asyncio.Future[Any]:
        """Queue one operation; the future settles once its group committed (or failed). The
        operation runs whether or not anyone still awaits the future."""
        if self._thread is None:
            raise DlqUnavailable("the DLQ is not open")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put(_Op(fn, fut, loop))
        return fut

    def _run(self) -> None:
        next_refresh = time.monotonic() + self._refresh_every()
        try:
            while True:
                try:
                    first = self._queue.get(timeout=max(0.0, next_refresh - time.monotonic()))
                except queue.Empty:
                    first = _REFRESH
                if first is None:
                    return
                if first is _REFRESH or time.monotonic() >= next_refresh:
                    next_refresh = time.monotonic() + self._refresh_every()
                    self._safe_refresh()
                    if first is _REFRESH:
                        continue
                batch = [first]
                stop = False
                while len(batch) < GROUP_MAX:
                    try:
                        item = self._queue.get_nowait()
                    except queue.Empty:
                        break
                    if item is None:
                        stop = True
                        break
                    batch.append(item)
                self._run_batch(batch)
                if stop:
                    return
        finally:
            self._last_check()
            self._conn.close()

    def _last_check(self) -> None:
        """Before the connection closes (a shutdown): the file at the path must still be the
        one written to. Deleted since the last check, it is written again now: closing a
        deleted file would lose every record it holds, acknowledged ones included."""
        try:
            self._conn = self._verify(self._conn)
        except (DlqUnavailable, sqlite3.Error, OSError) as exc:
            log.error("DLQ file check at shutdown failed: %s", exc)

    def _safe_refresh(self) -> None:
        try:
            self._conn = self._verify(self._conn)
            self._refresh(self._conn)
        except DlqUnavailable as exc:
            log.error("%s", exc)
        except sqlite3.Error as exc:
            log.warning("DLQ refresh failed (the gauges keep their last value): %s", exc)

    def _run_batch(self, batch: list[_Op]) -> None:
        conn = self._conn
        delta: Delta = {"records": 0, "bytes": 0}
        outcomes: list[tuple[bool, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for op in batch:
                conn.execute("SAVEPOINT op")
                before = dict(delta)
                try:
                    outcomes.append((True, op.fn(conn, delta)))
                    conn.execute("RELEASE op")
                except (sqlite3.Error, OSError):
                    raise
                except Exception as exc:
                    # A refusal (full, a claim not granted) or a bug: undo only this one.
                    if not isinstance(exc, REFUSALS):
                        log.exception("DLQ operation failed")
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    delta.clear()
                    delta.update(before)
                    outcomes.append((False, exc))
            conn.execute("COMMIT")
            # Before anyone is told "stored": the file committed to must still be the one
            # at the path (an unlinked file is lost at the next start).
            conn = self._conn = self._verify(conn)
        except DlqUnavailable as exc:
            outcomes = [(False, exc)] * len(batch)
            delta = {}
        except (sqlite3.Error, OSError) as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            if self._failures.allow():
                suppressed = self._failures.suppressed
                more = f" ({suppressed} similar suppressed)" if suppressed else ""
                log.error("DLQ write failed (%d operations refused): %s%s", len(batch), exc, more)
            err = DlqUnavailable(f"DLQ storage failed: {exc}")
            outcomes = [(False, err)] * len(batch)
            delta = {}
        if any(delta.values()):
            try:
                self._committed(conn, delta)
            except sqlite3.Error as exc:
                log.warning("DLQ gauge refresh failed: %s", exc)
        for op, (ok, value) in zip(batch, outcomes, strict=True):
            with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits
                op.loop.call_soon_threadsafe(_settle, op.fut, ok, value)


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)

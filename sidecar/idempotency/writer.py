"""The idempotency file's one writer thread, as the DLQ's: every operation (reads included, so
each sees every write before it) is queued from the event loop and run in this thread, as many
as are waiting in one transaction (one fsync per group), each under its own savepoint. A storage
error fails the whole group with StoreError; an operation's own bug fails only itself. The
operation runs whether or not anyone still awaits its future, in the order it was queued."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.idempotency.store import StoreError

log = logging.getLogger("sidecar.idempotency")

GROUP_MAX = 256
Operation = Callable[[sqlite3.Connection], Any]


@dataclass
class _KeyOp:
    fn: Operation
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


class KeyWriter:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn
        self._queue: queue.Queue[_KeyOp | None] = queue.Queue()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="idempotency-writer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Run what is queued, then end the thread (which closes the connection)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None

    def submit(self, fn: Operation) -> asyncio.Future[Any]:
        if self._thread is None:
            raise StoreError("the idempotency store is not open")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put(_KeyOp(fn, fut, loop))
        return fut

    def _run(self) -> None:
        try:
            while True:
                first = self._queue.get()
                if first is None:
                    return
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
            self._conn.close()

    def _run_batch(self, batch: list[_KeyOp]) -> None:
        conn = self._conn
        outcomes: list[tuple[bool, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for op in batch:
                conn.execute("SAVEPOINT op")
                try:
                    outcomes.append((True, op.fn(conn)))
                    conn.execute("RELEASE op")
                except (sqlite3.Error, OSError):
                    raise
                except Exception as exc:  # a bug in one operation: undo only it
                    log.exception("idempotency store operation failed")
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    outcomes.append((False, StoreError(f"operation failed: {exc}")))
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            log.error("idempotency store write failed (%d operations): %s", len(batch), exc)
            outcomes = [(False, StoreError(f"idempotency storage failed: {exc}"))] * len(batch)
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

"""The DLQ's storage: SQLite in WAL mode with synchronous=FULL, one writer thread.

Every write goes through one thread that groups what is queued into one transaction (group
commit), so the event loop never blocks on disk and a burst of failures costs one fsync per
group, not per record. ``add`` returns only after its transaction committed: an id handed to a
client is on disk. When the store is full (``max_records``/``max_bytes`` of pending+parked
records) a new record is refused with DlqFull and nothing stored is dropped; any SQLite or OS
error (disk full, read-only, I/O) refuses with DlqUnavailable and the proxy keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import queue
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.dlq.record import NewRecord

log = logging.getLogger("sidecar.dlq")

GROUP_MAX = 512
SCHEMA = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    route TEXT NOT NULL,
    status TEXT NOT NULL,
    method TEXT NOT NULL,
    target TEXT NOT NULL,
    headers TEXT NOT NULL,
    body BLOB NOT NULL,
    fate TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    last_status INTEGER,
    last_error TEXT,
    idempotency_key TEXT,
    replays INTEGER NOT NULL DEFAULT 0,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS records_status_route ON records(status, route, seq);
"""
COLUMNS = (
    "seq, id, route, status, method, target, fate, attempts, last_status, last_error, "
    "idempotency_key, replays, size, created_at, updated_at"
)


class DlqError(Exception):
    header = "unavailable"


class DlqFull(DlqError):
    header = "full"


class DlqUnavailable(DlqError):
    header = "unavailable"


@dataclass
class _Op:
    fn: Callable[[sqlite3.Connection, dict[str, int]], Any]
    fut: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


def new_id(now: float) -> str:
    """Time-ordered and unguessable: 13 hex digits of milliseconds, 8 random."""
    return f"{int(now * 1000):013x}{secrets.token_hex(4)}"


class DlqStore:
    def __init__(
        self,
        path: str,
        max_records: int,
        max_bytes: int,
        *,
        max_page_count: int | None = None,
    ) -> None:
        self.path = path
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._max_page_count = max_page_count  # tests: a real "database or disk is full"
        self._queue: queue.Queue[_Op | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._reader: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        # Held only by the writer thread and read by the loop: counts of kept records.
        self.held_records = 0
        self.held_bytes = 0
        self.by_status: dict[str, int] = {}
        self.corrupt_moved_to: str | None = None
        self.available = False

    def queue_depth(self) -> int:
        return self._queue.qsize()

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Check, create or recover the file, then start the writer thread."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        if os.path.exists(self.path) and not self._healthy():
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            moved = f"{self.path}.corrupt-{stamp}"
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, moved + suffix)
            self.corrupt_moved_to = moved
            log.error(
                "DLQ file %s failed its integrity check; moved aside to %s and a new one "
                "started (nothing was deleted)",
                self.path,
                moved,
            )
        writer = self._connect()
        writer.executescript(SCHEMA)
        for status, n, b in writer.execute(
            "SELECT status, COUNT(*), COALESCE(SUM(size), 0) FROM records GROUP BY status"
        ):
            self.by_status[status] = n
            if status != "delivered":
                self.held_records += n
                self.held_bytes += b
        self._reader = self._connect()
        self._thread = threading.Thread(
            target=self._writer, args=(writer,), name="dlq-writer", daemon=True
        )
        self._thread.start()
        self.available = True

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        conn.execute("PRAGMA busy_timeout=5000")
        if self._max_page_count is not None:
            conn.execute(f"PRAGMA max_page_count={int(self._max_page_count)}")
        return conn

    def _healthy(self) -> bool:
        try:
            conn = sqlite3.connect(self.path)
            try:
                row = conn.execute("PRAGMA quick_check").fetchone()
            finally:
                conn.close()
        except sqlite3.DatabaseError as exc:
            log.error("DLQ quick_check of %s failed: %s", self.path, exc)
            return False
        return row is not None and row[0] == "ok"

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=10)
            self._thread = None
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        self.available = False

    # -- the writer thread -----------------------------------------------------------------

    def _writer(self, conn: sqlite3.Connection) -> None:
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
                self._run_batch(conn, batch)
                if stop:
                    return
        finally:
            conn.close()

    def _run_batch(self, conn: sqlite3.Connection, batch: list[_Op]) -> None:
        delta: dict[str, int] = {"records": 0, "bytes": 0}
        outcomes: list[tuple[bool, Any]] = []
        try:
            conn.execute("BEGIN IMMEDIATE")
            for op in batch:
                conn.execute("SAVEPOINT op")
                try:
                    outcomes.append((True, op.fn(conn, delta)))
                    conn.execute("RELEASE op")
                except DlqFull as exc:
                    conn.execute("ROLLBACK TO op")
                    conn.execute("RELEASE op")
                    outcomes.append((False, exc))
            conn.execute("COMMIT")
        except (sqlite3.Error, OSError) as exc:
            with contextlib.suppress(sqlite3.Error):
                conn.execute("ROLLBACK")
            log.error("DLQ write failed (%d records refused): %s", len(batch), exc)
            err = DlqUnavailable(f"DLQ storage failed: {exc}")
            outcomes = [(False, err)] * len(batch)
            delta = {}
        self._apply_delta(delta)
        for op, (ok, value) in zip(batch, outcomes, strict=True):
            op.loop.call_soon_threadsafe(_settle, op.fut, ok, value)

    def _apply_delta(self, delta: dict[str, int]) -> None:
        self.held_records += delta.get("records", 0)
        self.held_bytes += delta.get("bytes", 0)
        for k, v in delta.items():
            if k.startswith("status:"):
                s = k[7:]
                self.by_status[s] = self.by_status.get(s, 0) + v

    async def _submit(self, fn: Callable[[sqlite3.Connection, dict[str, int]], Any]) -> Any:
        if not self.available or self._thread is None:
            raise DlqUnavailable("the DLQ is not open")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        self._queue.put(_Op(fn, fut, loop))
        return await fut

    # -- writes ----------------------------------------------------------------------------

    async def add(self, rec: NewRecord) -> str:
        """Store durably; returns the id after the commit. Raises DlqFull or DlqUnavailable."""
        size = rec.size

        def insert(conn: sqlite3.Connection, delta: dict[str, int]) -> str:
            if self.held_records + delta["records"] + 1 > self.max_records:
                raise DlqFull(f"the DLQ holds {self.max_records} records already")
            if self.held_bytes + delta["bytes"] + size > self.max_bytes:
                raise DlqFull(f"the DLQ holds {self.max_bytes} bytes already")
            rid = new_id(rec.created_at)
            conn.execute(
                "INSERT INTO records (id, route, status, method, target, headers, body, fate, "
                "attempts, last_status, last_error, idempotency_key, size, created_at, "
                "updated_at) VALUES (?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    rid,
                    rec.route,
                    rec.method,
                    rec.target,
                    json.dumps(rec.headers),
                    rec.body,
                    rec.fate,
                    rec.attempts,
                    rec.last_status,
                    rec.last_error,
                    rec.idempotency_key,
                    size,
                    rec.created_at,
                    rec.created_at,
                ),
            )
            delta["records"] += 1
            delta["bytes"] += size
            delta["status:pending"] = delta.get("status:pending", 0) + 1
            return rid

        result: str = await self._submit(insert)
        return result

    async def set_status(
        self,
        rid: str,
        status: str,
        *,
        count_replay: bool,
        last_status: int | None,
        last_error: str | None,
    ) -> None:
        now = time.time()

        def update(conn: sqlite3.Connection, delta: dict[str, int]) -> None:
            row = conn.execute("SELECT status, size FROM records WHERE id = ?", (rid,)).fetchone()
            if row is None:
                return
            old, size = row
            conn.execute(
                "UPDATE records SET status = ?, replays = replays + ?, last_status = ?, "
                "last_error = ?, updated_at = ? WHERE id = ?",
                (status, 1 if count_replay else 0, last_status, last_error, now, rid),
            )
            if old != status:
                delta[f"status:{old}"] = delta.get(f"status:{old}", 0) - 1
                delta[f"status:{status}"] = delta.get(f"status:{status}", 0) + 1
                if status == "delivered":
                    delta["records"] -= 1
                    delta["bytes"] -= size

        await self._submit(update)

    async def delete(self, rid: str) -> bool:
        def remove(conn: sqlite3.Connection, delta: dict[str, int]) -> bool:
            row = conn.execute("SELECT status, size FROM records WHERE id = ?", (rid,)).fetchone()
            if row is None:
                return False
            status, size = row
            conn.execute("DELETE FROM records WHERE id = ?", (rid,))
            delta[f"status:{status}"] = delta.get(f"status:{status}", 0) - 1
            if status != "delivered":
                delta["records"] -= 1
                delta["bytes"] -= size
            return True

        ok: bool = await self._submit(remove)
        return ok

    async def prune_delivered(self, older_than: float) -> int:
        def prune(conn: sqlite3.Connection, delta: dict[str, int]) -> int:
            cur = conn.execute(
                "DELETE FROM records WHERE status = 'delivered' AND updated_at < ?", (older_than,)
            )
            delta["status:delivered"] = delta.get("status:delivered", 0) - cur.rowcount
            return cur.rowcount

        n: int = await self._submit(prune)
        return n

    # -- reads (a separate connection; WAL lets it read while the writer writes) -----------

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self._reader is None:
            raise DlqUnavailable("the DLQ is not open")
        with self._read_lock:
            try:
                return self._reader.execute(sql, args).fetchall()
            except sqlite3.Error as exc:
                raise DlqUnavailable(f"DLQ read failed: {exc}") from None

    async def list(
        self,
        route: str | None = None,
        status: str | None = None,
        limit: int = 50,
        newest_first: bool = True,
        cursor: int | None = None,
    ) -> tuple[list[dict[str, Any]], int | None]:
        where: list[str] = []
        args: list[Any] = []
        if route:
            where.append("route = ?")
            args.append(route)
        if status:
            where.append("status = ?")
            args.append(status)
        if cursor is not None:
            where.append("seq < ?" if newest_first else "seq > ?")
            args.append(cursor)
        sql = f"SELECT {COLUMNS} FROM records"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY seq {'DESC' if newest_first else 'ASC'} LIMIT ?"
        args.append(limit + 1)
        rows = await asyncio.to_thread(self._read, sql, tuple(args))
        out = [_summary(r) for r in rows[:limit]]
        nxt = rows[limit - 1][0] if len(rows) > limit else None
        return out, nxt

    async def get(self, rid: str) -> dict[str, Any] | None:
        rows = await asyncio.to_thread(
            self._read, f"SELECT {COLUMNS}, headers, body FROM records WHERE id = ?", (rid,)
        )
        if not rows:
            return None
        r = rows[0]
        out = _summary(r[:15])
        out["headers"] = [list(h) for h in json.loads(r[15])]
        out["body_bytes"] = bytes(r[16])
        return out

    def oldest_pending_sync(self) -> float | None:
        """For /metrics: one indexed read on the reader connection."""
        rows = self._read(
            "SELECT created_at FROM records WHERE status = 'pending' ORDER BY seq LIMIT 1", ()
        )
        return float(rows[0][0]) if rows else None


def _summary(r: tuple[Any, ...]) -> dict[str, Any]:
    return {
        "seq": r[0],
        "id": r[1],
        "route": r[2],
        "status": r[3],
        "method": r[4],
        "target": r[5],
        "fate": r[6],
        "attempts": r[7],
        "last_status": r[8],
        "last_error": r[9],
        "idempotency_key": r[10],
        "replays": r[11],
        "size": r[12],
        "created_at": r[13],
        "updated_at": r[14],
    }


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)

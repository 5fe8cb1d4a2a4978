"""The embedded idempotency store: one SQLite file in WAL mode with ``synchronous=FULL``, one
writer thread (``writer.KeyWriter``), as the DLQ keeps its records.

A claim is one transaction that reads the key, decides (``decision.decide``) and writes, so
concurrent claims of one key -- from coroutines of this process, or from other processes sharing
the file -- give exactly one ``Claimed``. ``complete`` returns only once its transaction has
committed: an answer acknowledged is on disk and survives a restart. Each call is bounded by
``timeout``; a claim that timed out is undone by a release queued behind it (the writer runs in
order), so a late claim never holds a key nobody owns.

Times are wall clock (``clock.wall()``): a key outlives the process and is shared between
processes. The transaction bodies are module functions (``claim_tx``, ...) taking the
connection and ``now``: the writer thread runs them, and a test runs them in a process it kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import sqlite3
import threading
from typing import Any

from sidecar.core import Clock
from sidecar.idempotency import schema
from sidecar.idempotency.decision import Decision, KeyState, decide
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.store import (
    Busy,
    Claimed,
    ClaimResult,
    Finished,
    KeyRecord,
    Mismatch,
    StoreError,
)
from sidecar.idempotency.writer import KeyWriter, Operation

CALL_TIMEOUT = 2.0  # seconds a call may take before it is a store error
ABANDONED_KEEP = 24 * 3600.0  # seconds an abandoned claim is kept past its lease (counted)
FILE_MODE = 0o600
COLUMNS = "key, finished, fingerprint, token, created_at, expires_at, status, headers, body, size"


def _headers_json(headers: tuple[tuple[bytes, bytes], ...]) -> str:
    return json.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers])


def _record(row: tuple[Any, ...]) -> KeyRecord:
    key, finished, fp, _token, created, expires, status, headers, body, size = row
    answer = None
    if finished:
        pairs = tuple(
            (k.encode("latin-1"), v.encode("latin-1")) for k, v in json.loads(headers or "[]")
        )
        answer = KeptAnswer(int(status), pairs, None if body is None else bytes(body), size)
    return KeyRecord(key, bool(finished), fp, created, expires, answer)


def _row(conn: sqlite3.Connection, key: str) -> tuple[Any, ...] | None:
    row: tuple[Any, ...] | None = conn.execute(
        f"SELECT {COLUMNS} FROM idempotency_keys WHERE key = ?", (key,)
    ).fetchone()
    return row


def claim_tx(
    conn: sqlite3.Connection, key: str, fingerprint: str, lease: float, token: str, now: float
) -> ClaimResult:
    row = _row(conn, key)
    state = None if row is None else KeyState(bool(row[1]), row[2], row[5])
    decision = decide(state, fingerprint, now)
    if decision is Decision.FIRST or decision is Decision.LEASE_EXPIRED:
        conn.execute(
            "INSERT OR REPLACE INTO idempotency_keys "
            "(key, finished, fingerprint, token, created_at, expires_at) VALUES (?, 0, ?, ?, ?, ?)",
            (key, fingerprint, token, now, now + lease),
        )
        return Claimed(token, took_over=decision is Decision.LEASE_EXPIRED)
    assert row is not None
    if decision is Decision.IN_PROGRESS:
        return Busy(float(row[5]))
    if decision is Decision.MISMATCH:
        return Mismatch()
    return Finished(_record(row))


def complete_tx(
    conn: sqlite3.Connection, key: str, token: str, answer: KeptAnswer, ttl: float, now: float
) -> bool:
    cur = conn.execute(
        "UPDATE idempotency_keys SET finished = 1, token = NULL, created_at = ?, expires_at = ?, "
        "status = ?, headers = ?, body = ?, size = ? "
        "WHERE key = ? AND token = ? AND finished = 0",
        (
            now,
            now + ttl,
            answer.status,
            _headers_json(answer.headers),
            answer.body,
            answer.size,
            key,
            token,
        ),
    )
    return cur.rowcount == 1


def release_tx(conn: sqlite3.Connection, key: str, token: str) -> bool:
    cur = conn.execute(
        "DELETE FROM idempotency_keys WHERE key = ? AND token = ? AND finished = 0", (key, token)
    )
    return cur.rowcount == 1


def renew_tx(conn: sqlite3.Connection, key: str, token: str, lease: float, now: float) -> bool:
    cur = conn.execute(
        "UPDATE idempotency_keys SET expires_at = ? WHERE key = ? AND token = ? AND finished = 0",
        (now + lease, key, token),
    )
    return cur.rowcount == 1


def prune_tx(conn: sqlite3.Connection, limit: int, now: float, abandoned_keep: float) -> int:
    cur = conn.execute(
        "DELETE FROM idempotency_keys WHERE key IN (SELECT key FROM idempotency_keys "
        "WHERE (finished = 1 AND expires_at <= ?) OR (finished = 0 AND expires_at <= ?) "
        "LIMIT ?)",
        (now, now - abandoned_keep, limit),
    )
    return cur.rowcount


def connect(path: str, busy_timeout_ms: int) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL, synchronous=FULL."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
    except BaseException:
        conn.close()
        raise
    return conn


class SqliteIdempotencyStore:
    """``IdempotencyStore`` on one SQLite file. ``open`` and ``close`` block: call them in a
    thread (``asyncio.to_thread``); every other method is a coroutine for the event loop."""

    def __init__(
        self,
        path: str,
        clock: Clock,
        *,
        timeout: float = CALL_TIMEOUT,
        abandoned_keep: float = ABANDONED_KEEP,
        busy_timeout_ms: int = 5000,
    ) -> None:
        self.path = path
        self._clock = clock
        self._timeout = timeout
        self._abandoned_keep = abandoned_keep
        self._busy_timeout_ms = busy_timeout_ms
        self._writer: KeyWriter | None = None
        # ``close`` may come from the event loop while ``open`` runs in a worker thread (a
        # shutdown during the opening): whichever comes second stops the writer.
        self._lock = threading.Lock()
        self._closed = False

    @property
    def is_open(self) -> bool:
        return self._writer is not None

    def open(self) -> None:
        """Open (create, migrate) the file and start its writer thread. After ``close`` (a
        shutdown that came while this ran in a thread) the writer it started is stopped here
        again and the store stays closed."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        # Created owner-only (answers hold response bodies); -wal and -shm get the same mode.
        with contextlib.suppress(FileExistsError):
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE))
        conn = connect(self.path, self._busy_timeout_ms)
        try:
            schema.migrate(conn)
        except BaseException:
            conn.close()
            raise
        writer = KeyWriter(conn)
        writer.start()
        with self._lock:
            if not self._closed:
                self._writer = writer
                return
        writer.stop()

    def close(self) -> None:
        """Run what was queued, stop the writer; the store stays closed."""
        with self._lock:
            self._closed = True
            writer, self._writer = self._writer, None
        if writer is not None:
            writer.stop()

    async def _call(self, fn: Operation, undo: Operation | None = None) -> Any:
        if self._writer is None:
            raise StoreError("the idempotency store is not open")
        fut = self._writer.submit(fn)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), self._timeout)
        except TimeoutError:
            if undo is not None:
                self._writer.submit(undo)  # runs after fn, whenever fn runs
            raise StoreError(
                f"the idempotency store did not answer within {self._timeout} s"
            ) from None
        except asyncio.CancelledError:
            if undo is not None:  # the caller is gone: what fn does must not outlive it
                self._writer.submit(undo)
            raise

    async def claim(self, key: str, fingerprint: str, lease: float) -> ClaimResult:
        token = secrets.token_hex(16)
        clock = self._clock
        result: ClaimResult = await self._call(
            lambda conn: claim_tx(conn, key, fingerprint, lease, token, clock.wall()),
            undo=lambda conn: release_tx(conn, key, token),
        )
        return result

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> bool:
        clock = self._clock
        done: bool = await self._call(
            lambda conn: complete_tx(conn, key, token, answer, ttl, clock.wall())
        )
        return done

    async def release(self, key: str, token: str) -> bool:
        done: bool = await self._call(lambda conn: release_tx(conn, key, token))
        return done

    async def renew(self, key: str, token: str, lease: float) -> bool:
        clock = self._clock
        done: bool = await self._call(lambda conn: renew_tx(conn, key, token, lease, clock.wall()))
        return done

    async def get(self, key: str) -> KeyRecord | None:
        row = await self._call(lambda conn: _row(conn, key))
        return None if row is None else _record(row)

    async def forget(self, key: str) -> bool:
        def op(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM idempotency_keys WHERE key = ?", (key,)).rowcount == 1

        done: bool = await self._call(op)
        return done

    async def prune(self, limit: int) -> int:
        clock, keep = self._clock, self._abandoned_keep
        deleted: int = await self._call(lambda conn: prune_tx(conn, limit, clock.wall(), keep))
        return deleted

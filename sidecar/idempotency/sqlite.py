"""The embedded idempotency store: one SQLite file in WAL mode with ``synchronous=NORMAL``, its
transactions run on the event loop thread, one connection, no thread hop and no fsync on the
request path (a thread hop costs a GIL convoy on a busy loop, an fsync milliseconds on a shared
disk: either breaks the cost bar of a guarded write).

A claim is one transaction that reads the key, decides (``decision.decide``) and writes, so
concurrent claims of one key -- from coroutines of this process (a call runs to its end without
yielding, so it cannot be cancelled half-way), or from other processes sharing the file -- give
exactly one ``Claimed``; a crash leaves no key or a whole one. A lock held elsewhere is waited
for at most ``busy_timeout_ms`` (50 ms: one sidecar owns its file), then the call is a
``StoreError`` and the route's ``on_store_error`` applies: the loop is never held longer.

Durability (``durability.sync_forever``, the ``idempotency-sync`` task): a committed key is in
the WAL, in the OS page cache, as soon as its call returns, so it survives a crash of the
process (SIGKILL, OOM kill). ``checkpoint`` -- a passive WAL checkpoint, which fsyncs the WAL
first and takes no write lock -- runs in a worker thread on its own connection every 100 ms
after a write, and a full one at ``close``: a power loss or kernel crash may roll back at most
about the last 100 ms of keys (they then behave as at-least-once, as a sidecar killed
mid-request). No checkpoint runs on the loop (``wal_autocheckpoint=0`` on its connection).

The WAL stays bounded. A passive checkpoint never shortens the log, and under sustained writes
one always lands while it runs, so SQLite never starts the log again from its beginning: it
grew without end (216 MB after 7,500 writes). When a checkpoint leaves the log past
``WAL_RESET_BYTES``, ``reset_log`` holds the store's calls (they wait on the loop, which stays
free; none is half-way, as each runs to its end without yielding) while a ``TRUNCATE``
checkpoint in a worker thread copies the few frames the passive one left and empties the log.
``journal_size_limit`` cuts a log that SQLite starts again by itself to the same size.

Times are wall clock (``clock.wall()``): a key outlives the process and is shared between
processes. The transaction bodies are module functions (``claim_tx``, ...) taking the
connection and ``now``: the store runs them, and a test runs them in a process it kills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from sidecar.core import Clock
from sidecar.idempotency import schema
from sidecar.idempotency.decision import Decision, KeyState, decide
from sidecar.idempotency.keep import KeptAnswer, without_body
from sidecar.idempotency.store import (
    ABANDONED_KEEP,
    HOLDERS_MAX,
    Busy,
    Claimed,
    ClaimResult,
    Finished,
    Kept,
    KeyRecord,
    Mismatch,
    StoreError,
    StoreFull,
    headers_text,
    read_answer,
)

log = logging.getLogger("sidecar.idempotency")

WAL_RESET_BYTES = 16 << 20  # a log past this after a checkpoint is emptied (``reset_log``)
BUSY_TIMEOUT_MS = 50  # the longest a call waits for a lock held elsewhere (on the loop thread)
FILE_MODE = 0o600
T = TypeVar("T")
COLUMNS = "key, finished, fingerprint, token, created_at, expires_at, status, headers, body, size"


def _record(row: tuple[Any, ...]) -> KeyRecord:
    key, finished, fp, _token, created, expires, status, headers, body, size = row
    answer = None
    if finished:  # checked: a damaged one is a StoreError, never replayed
        answer = read_answer(status, headers, body, size)
    return KeyRecord(key, bool(finished), fp, created, expires, answer)


def _row(conn: sqlite3.Connection, key: str) -> tuple[Any, ...] | None:
    row: tuple[Any, ...] | None = conn.execute(
        f"SELECT {COLUMNS} FROM idempotency_keys WHERE key = ?", (key,)
    ).fetchone()
    return row


@dataclass(frozen=True, slots=True)
class Bounds:
    """``idempotency.max_records`` / ``max_bytes``: past either, a new key is refused; an
    answer that would put the file past ``max_bytes`` is kept without its body."""

    max_records: int
    max_bytes: int


def tally(conn: sqlite3.Connection) -> tuple[int, int]:
    """The keys the file holds and their bytes (``schema.TALLY``)."""
    records, size = conn.execute(
        "SELECT records, bytes FROM idempotency_tally WHERE id = 0"
    ).fetchone()
    return int(records), int(size)


def claim_tx(
    conn: sqlite3.Connection,
    key: str,
    fingerprint: str,
    lease: float,
    token: str,
    now: float,
    *,
    bounds: Bounds | None = None,
    legacy: str | None = None,
) -> ClaimResult:
    row = _row(conn, key)
    if row is None and legacy is not None:
        # The previous version's name for the same key, read only: judged as the key's own
        # while live; past its ttl or lease, as absent (the new name is claimed).
        old = _row(conn, legacy)
        if old is not None:
            judged = decide(KeyState(bool(old[1]), old[2], old[5]), fingerprint, now)
            if judged is Decision.IN_PROGRESS:
                return Busy(float(old[5]))
            if judged is Decision.MISMATCH:
                return Mismatch()
            if judged is Decision.REPLAYED:
                return Finished(_record(old))
    state = None if row is None else KeyState(bool(row[1]), row[2], row[5])
    decision = decide(state, fingerprint, now)
    if decision is Decision.FIRST or decision is Decision.LEASE_EXPIRED:
        if row is None and bounds is not None:  # a new key: within the bounds?
            records, size = tally(conn)
            if records >= bounds.max_records:
                raise StoreFull(f"the idempotency store holds {bounds.max_records} keys already")
            if size >= bounds.max_bytes:
                raise StoreFull(f"the idempotency store holds {bounds.max_bytes} bytes already")
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
    conn: sqlite3.Connection,
    key: str,
    token: str,
    answer: KeptAnswer,
    ttl: float,
    now: float,
    *,
    bounds: Bounds | None = None,
) -> Kept:
    """Finish the key with ``answer`` if the claim is ours. An answer whose body would put the
    file past ``bounds.max_bytes`` is kept without its body (``without_body``): the key is still
    finished (the write ran: it must never run again), so the tally passes the bound by at most
    one key's head (its key, fingerprint and ``OVERHEAD``), never by an answer."""
    row = _row(conn, key)
    if row is None or row[1] or row[3] != token:
        return Kept.NOT_OURS
    whole = True
    if bounds is not None and answer.body is not None:
        _records, size = tally(conn)
        # What the update adds to the tally (``schema.TALLY``'s count of a row, as SQLite
        # measures it): the kept headers and body (a row in progress holds neither).
        (grows,) = conn.execute(
            "SELECT length(?) + length(?)", (headers_text(answer.headers), answer.body)
        ).fetchone()
        if size + int(grows) > bounds.max_bytes:
            answer, whole = without_body(answer), False
    cur = conn.execute(
        "UPDATE idempotency_keys SET finished = 1, token = NULL, created_at = ?, expires_at = ?, "
        "status = ?, headers = ?, body = ?, size = ? "
        "WHERE key = ? AND token = ? AND finished = 0",
        (
            now,
            now + ttl,
            answer.status,
            headers_text(answer.headers),
            answer.body,
            answer.size,
            key,
            token,
        ),
    )
    if cur.rowcount != 1:
        return Kept.NOT_OURS
    return Kept.WHOLE if whole else Kept.WITHOUT_BODY


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


def connect(
    path: str,
    busy_timeout_ms: int,
    synchronous: str = "NORMAL",
    journal_limit: int = WAL_RESET_BYTES,
) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), WAL, ``synchronous`` as
    given, no automatic checkpoint (the store's ``checkpoint`` runs them, off the loop), a log
    that SQLite starts again cut to ``journal_limit`` bytes."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute(f"PRAGMA synchronous={synchronous}")
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute(f"PRAGMA journal_size_limit={int(journal_limit)}")
        conn.execute("PRAGMA recursive_triggers=ON")  # a REPLACE counted out of the tally
    except BaseException:
        conn.close()
        raise
    return conn


def _transaction(conn: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
    """``fn`` in one write transaction; any failure rolls it back whole and is a StoreError."""
    try:
        conn.execute("BEGIN IMMEDIATE")
    except sqlite3.Error as exc:
        raise StoreError(f"idempotency storage unavailable: {exc}") from None
    try:
        value = fn(conn)
        conn.execute("COMMIT")
    except BaseException as exc:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        if isinstance(exc, StoreError):  # a damaged record read back, or a refusal (StoreFull)
            raise
        if isinstance(exc, (sqlite3.Error, OSError)):
            raise StoreError(f"idempotency storage failed: {exc}") from None
        if isinstance(exc, Exception):  # a bug in the operation: logged, a store error
            log.exception("idempotency store operation failed")
            raise StoreError(f"operation failed: {exc}") from None
        raise
    return value


class SqliteIdempotencyStore:
    """``IdempotencyStore`` on one SQLite file. ``open`` and ``close`` block (``open`` may run
    in a thread, ``asyncio.to_thread``; ``close`` after ``detach`` on the loop); the calls are
    coroutines that run to their end on the loop thread without yielding."""

    def __init__(
        self,
        path: str,
        clock: Clock,
        *,
        abandoned_keep: float = ABANDONED_KEEP,
        busy_timeout_ms: int = BUSY_TIMEOUT_MS,
        wal_reset_bytes: int = WAL_RESET_BYTES,
        bounds: Bounds | None = None,
    ) -> None:
        self.path = path
        self.bounds = bounds
        self.wal_reset_bytes = wal_reset_bytes
        self.wal_resets = 0  # logs emptied by ``reset_log``
        self._clock = clock
        self._abandoned_keep = abandoned_keep
        self._busy_timeout_ms = busy_timeout_ms
        self._conn: sqlite3.Connection | None = None  # the loop's: every call
        self._detached: sqlite3.Connection | None = None  # the loop's, between detach and close
        self._sync: sqlite3.Connection | None = None  # the checkpoints', in a worker thread
        self._written = False  # a write committed since the last checkpoint began
        # ``close`` may come from the event loop while ``open`` runs in a worker thread (a
        # shutdown during the opening): whichever comes second closes the connections.
        self._lock = threading.Lock()
        self._closed = False
        # One checkpoint at a time, and none while (or after) the files are closed.
        self._sync_lock = threading.Lock()
        self._held: asyncio.Event | None = None  # set while ``reset_log`` holds the calls

    @property
    def is_open(self) -> bool:
        return self._conn is not None

    def open(self) -> None:
        """Open (create, migrate) the file and its two connections. After ``close`` (a
        shutdown that came while this ran in a thread) the connections it opened are closed
        here again and the store stays closed."""
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, mode=0o700, exist_ok=True)
        # Created owner-only (answers hold response bodies); -wal and -shm get the same mode.
        with contextlib.suppress(FileExistsError):
            os.close(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE))
        conn = connect(self.path, self._busy_timeout_ms, journal_limit=self.wal_reset_bytes)
        try:
            schema.migrate(conn)
            sync = connect(self.path, self._busy_timeout_ms, journal_limit=self.wal_reset_bytes)
        except BaseException:
            conn.close()
            raise
        with self._lock:
            if not self._closed:
                self._conn, self._sync = conn, sync
                return
        sync.close()
        conn.close()

    def detach(self) -> None:
        """Take no more calls (each is a StoreError from now on). On the loop thread: no call
        is then half-way, so ``close`` may finish in another thread."""
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._detached, self._conn = self._conn, None

    def close(self) -> None:
        """Take no more calls, checkpoint in full (the WAL and the file fsynced) and close the
        file; the store stays closed. Blocking: with no loop running, or after ``detach`` on
        the loop thread."""
        self.detach()
        with self._lock:
            conn, self._detached = self._detached, None
        with self._sync_lock:  # after a checkpoint still running in a worker thread
            sync, self._sync = self._sync, None
            if sync is not None:
                sync.close()
            if conn is not None:
                try:
                    conn.execute("PRAGMA wal_checkpoint(FULL)")
                except sqlite3.Error as exc:
                    log.warning("idempotency store: final checkpoint failed: %s", exc)
                finally:
                    conn.close()

    def take_written(self) -> bool:
        """Whether a write committed since the last call (and forget it). On the loop."""
        written, self._written = self._written, False
        return written

    def checkpoint(self) -> bool:
        """Make every committed key durable: a passive checkpoint on the store's second
        connection, which fsyncs the WAL before it copies it into the file, and takes no write
        lock (the loop's writes go on meanwhile). Blocking: run it in a worker thread. True
        when the log is left past ``wal_reset_bytes``: ``reset_log`` is due."""
        with self._sync_lock:
            sync = self._sync
            if sync is None:
                return False
            try:
                _busy, logged, copied = sync.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                if logged > copied:  # frames a reader still needed were not copied nor synced
                    fd = os.open(self.path + "-wal", os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            except (sqlite3.Error, OSError) as exc:
                self._written = True  # still to be made durable: the next tick tries again
                raise StoreError(f"idempotency checkpoint failed: {exc}") from None
            return self.wal_bytes() > self.wal_reset_bytes

    def wal_bytes(self) -> int:
        """The write-ahead log's size on disk now (0 when there is none)."""
        try:
            return os.stat(self.path + "-wal").st_size
        except FileNotFoundError:
            return 0

    async def reset_log(self) -> None:
        """Empty the log: the store's calls held (they wait, the loop stays free) while a
        ``TRUNCATE`` checkpoint runs in a worker thread; let go however it ends. Cancelled,
        the calls go on at once (the checkpoint ends in its thread; a call meeting it waits
        for it at most ``busy_timeout_ms``)."""
        if self._held is not None:
            return
        held = self._held = asyncio.Event()
        try:
            await asyncio.to_thread(self._truncate)
        finally:
            self._held = None
            held.set()

    def _truncate(self) -> None:
        with self._sync_lock:
            sync = self._sync
            if sync is None:
                return
            try:
                busy, _logged, _copied = sync.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
            except sqlite3.Error as exc:
                raise StoreError(f"idempotency log reset failed: {exc}") from None
            if not busy:
                self.wal_resets += 1

    async def _unheld(self) -> None:
        """Wait while ``reset_log`` holds the calls (at once otherwise)."""
        while (held := self._held) is not None:
            await held.wait()

    def _conn_or_error(self) -> sqlite3.Connection:
        conn = self._conn
        if conn is None:
            raise StoreError("the idempotency store is not open")
        return conn

    def _write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        value = _transaction(self._conn_or_error(), fn)
        self._written = True
        return value

    async def claim(
        self, key: str, fingerprint: str, lease: float, legacy: str | None = None
    ) -> ClaimResult:
        await self._unheld()
        token, now = secrets.token_hex(16), self._clock.wall()
        bounds = self.bounds
        return self._write(
            lambda conn: claim_tx(
                conn, key, fingerprint, lease, token, now, bounds=bounds, legacy=legacy
            )
        )

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> Kept:
        await self._unheld()
        now, bounds = self._clock.wall(), self.bounds
        return self._write(
            lambda conn: complete_tx(conn, key, token, answer, ttl, now, bounds=bounds)
        )

    async def release(self, key: str, token: str) -> bool:
        await self._unheld()
        return self._write(lambda conn: release_tx(conn, key, token))

    async def renew(self, key: str, token: str, lease: float) -> bool:
        await self._unheld()
        now = self._clock.wall()
        return self._write(lambda conn: renew_tx(conn, key, token, lease, now))

    async def get(self, key: str) -> KeyRecord | None:
        await self._unheld()
        try:
            row = _row(self._conn_or_error(), key)
        except sqlite3.Error as exc:
            raise StoreError(f"idempotency storage failed: {exc}") from None
        return None if row is None else _record(row)

    async def forget(self, key: str) -> bool:
        await self._unheld()

        def op(conn: sqlite3.Connection) -> bool:
            return conn.execute("DELETE FROM idempotency_keys WHERE key = ?", (key,)).rowcount == 1

        return self._write(op)

    async def holders(self, key: str) -> list[str]:
        try:
            rows = (
                self._conn_or_error()
                .execute(
                    f"SELECT key FROM idempotency_keys WHERE {schema.BARE_KEY} = ? "
                    "ORDER BY key LIMIT ?",
                    (key, HOLDERS_MAX),
                )
                .fetchall()
            )
        except sqlite3.Error as exc:
            raise StoreError(f"idempotency storage failed: {exc}") from None
        return [str(row[0]) for row in rows]

    async def prune(self, limit: int) -> int:
        await self._unheld()
        now, keep = self._clock.wall(), self._abandoned_keep
        return self._write(lambda conn: prune_tx(conn, limit, now, keep))

"""The DLQ's storage: SQLite in WAL mode with synchronous=FULL, one writer thread.

Every write goes through one thread that groups what is queued into one transaction (group
commit), so the event loop never blocks on disk and a burst of failures costs one fsync per
group, not per record. ``add`` returns only after its transaction committed: an id handed to a
client is on disk. When the store is full (``max_records``/``max_bytes`` of pending+parked
records) a new record is refused with DlqFull and nothing stored is dropped; any SQLite or OS
error (disk full, read-only, I/O) refuses with DlqUnavailable and the proxy keeps serving.

Replays claim a record in the file itself (a compare-and-set on its status and claim), so no two
replays anywhere -- in this process or another one sharing the file -- send it at once, and a
delivered record is never sent again. A claim is a lease: a process that dies holding one leaves
it behind until ``claim_expires_at``, after which anyone may claim the record again (it is then
marked as possibly having reached the upstream, since nobody knows how far the dead replay got).

The counts and the oldest pending record's age (the ``dlq_records`` and
``dlq_oldest_record_age_seconds`` gauges) are published by the writer thread after each group
and recounted from the file every ``REFRESH_EVERY`` seconds, which also picks up what other
processes wrote; a metrics scrape only reads that published value and never touches SQLite.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from sidecar.dlq import schema
from sidecar.dlq.errors import (
    DlqFull,
    DlqUnavailable,
    RecordBusy,
    RecordDelivered,
    RecordNotFound,
    RecordNotInStatus,
)
from sidecar.dlq.record import NewRecord
from sidecar.dlq.writer import Delta, GroupWriter, Operation

log = logging.getLogger("sidecar.dlq")

REFRESH_EVERY = 10.0  # seconds between full recounts of the file (other processes' writes)
COLUMNS = (
    "seq, id, route, status, method, target, fate, attempts, last_status, last_error, "
    "idempotency_key, replays, size, created_at, updated_at, reached_upstream, claimed_by, "
    "claimed_at, claim_expires_at, parked_reason"
)
_NCOLS = COLUMNS.count(",") + 1
INSERT = (
    "INSERT INTO records (id, route, status, method, target, headers, body, fate, attempts, "
    "last_status, last_error, idempotency_key, size, created_at, updated_at, reached_upstream) "
    "VALUES (?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
ID_TRIES = 5


@dataclass(frozen=True, slots=True)
class Counts:
    """What the gauges show; replaced whole by the writer thread, read by the loop."""

    by_status: dict[str, int] = field(default_factory=dict)
    oldest_pending: float | None = None  # created_at (epoch) of the oldest pending record


@dataclass(frozen=True, slots=True)
class Finish:
    """The end of one claimed replay."""

    status: str  # pending | delivered | parked
    count_replay: bool
    last_status: int | None
    last_error: str | None
    reached: bool  # this replay may have put bytes on the wire to the upstream
    parked_reason: str | None = None


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
        busy_timeout_ms: int = 5000,
    ) -> None:
        self.path = path
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._max_page_count = max_page_count  # tests: a real "database or disk is full"
        self._busy_timeout_ms = busy_timeout_ms
        self._writer: GroupWriter | None = None
        self._reader: sqlite3.Connection | None = None
        self._read_lock = threading.Lock()
        # Written only by the writer thread: kept (pending + parked) records and bytes.
        self.held_records = 0
        self.held_bytes = 0
        self._by_status: dict[str, int] = {}
        self.counts = Counts()
        self.corrupt_moved_to: str | None = None
        self.available = False
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file opened
        self.recreated = 0  # times the file was found deleted and written anew (writer thread)
        self._replaced = False  # another file was put at the path: never written to
        # Told (from the writer thread) each time the file was recreated; the app counts it.
        self.on_recreated: Callable[[], None] = lambda: None

    @property
    def by_status(self) -> dict[str, int]:
        return self.counts.by_status

    def queue_depth(self) -> int:
        return self._writer.depth() if self._writer is not None else 0

    def set_limits(self, max_records: int, max_bytes: int) -> None:
        """A reload: new bounds apply to the next record stored. Lowering them below what is
        held refuses new records (``full``); nothing stored is dropped."""
        self.max_records = max_records
        self.max_bytes = max_bytes

    # -- lifecycle -------------------------------------------------------------------------

    def open(self) -> None:
        """Check, create or recover the file, then start the writer thread.

        Another process opening the same file at the same moment can hold a lock that SQLite
        reports at once as "database is locked", without waiting for the busy timeout (the
        switch to WAL, the schema migration). Opening is then tried again, backing off, for up
        to the busy timeout: a sidecar must not run its whole life without its DLQ because a
        neighbour started in the same instant."""
        give_up = time.monotonic() + self._busy_timeout_ms / 1000.0
        delay = 0.01
        while True:
            try:
                self._open_once()
                return
            except sqlite3.OperationalError as exc:
                if not _locked(exc) or time.monotonic() + delay > give_up:
                    raise
            time.sleep(delay)  # a worker thread: the event loop is not blocked
            delay = min(delay * 2, 0.2)

    def _open_once(self) -> None:
        if os.path.exists(self.path) and not self._healthy():
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            moved = f"{self.path}.corrupt-{stamp}"
            for suffix in schema.SUFFIXES:
                if os.path.exists(self.path + suffix):
                    os.replace(self.path + suffix, moved + suffix)
            self.corrupt_moved_to = moved
            log.error(
                "DLQ file %s failed its integrity check; moved aside to %s and a new one "
                "started (nothing was deleted)",
                self.path,
                moved,
            )
        schema.prepare_private_file(self.path)
        writer = self._connect()
        try:
            schema.migrate(writer)
            self._file = _identity(self.path)
            self._recount(writer)
            self._reader = self._connect()
        except BaseException:
            writer.close()
            raise
        self._writer = GroupWriter(
            writer, self._committed, self._recount, lambda: REFRESH_EVERY, self._still_ours
        )
        self._writer.start()
        self.available = True

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self._busy_timeout_ms)}")
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=FULL")
            if self._max_page_count is not None:
                conn.execute(f"PRAGMA max_page_count={int(self._max_page_count)}")
        except BaseException:
            conn.close()
            raise
        return conn

    def _healthy(self) -> bool:
        """True when the file passes ``PRAGMA quick_check``; False only when SQLite says it is
        damaged (SQLITE_CORRUPT, SQLITE_NOTADB, or a quick_check answer other than ``ok``).
        Any other error -- a full disk that cannot take the ``-shm``, an I/O error, a lock, a
        permission -- says nothing about the file: it is raised, and the file stays where it
        is (moving a healthy file aside would empty the queue)."""
        try:
            conn = sqlite3.connect(self.path)
            try:
                row = conn.execute("PRAGMA quick_check").fetchone()
            finally:
                conn.close()
        except sqlite3.DatabaseError as exc:
            if not damaged(exc):
                raise
            log.error("DLQ quick_check of %s failed: %s", self.path, exc)
            return False
        if row is not None and row[0] == "ok":
            return True
        log.error("DLQ quick_check of %s found damage: %s", self.path, row)
        return False

    # -- the file deleted under a running process ------------------------------------------

    def _still_ours(self, conn: sqlite3.Connection) -> sqlite3.Connection:
        """In the writer thread, after each commit (before anyone is told "stored") and
        before each refresh: the file at the path must be the one ``conn`` writes to.

        Deleted (a careless ``rm``): what the open file holds -- the group just committed
        included -- is copied to a new file at the path, connections move to it, and it is
        said loudly (an error line, ``dlq_file_recreated_total``); the connection to go on with
        is returned. Replaced by another file: that file is not ours to overwrite or merge
        into; the DLQ stops taking records (unavailable until a restart opens the new file).
        Raises DlqUnavailable when nothing committed now may be acknowledged. A copy that
        failed (the volume full) is tried again at every later check -- the periodic one and
        the last one before the file is closed -- until it succeeds: the open file is all
        there is of the records until then."""
        if self._replaced:
            raise DlqUnavailable("the DLQ file was replaced while in use; restart to open it")
        now = _identity(self.path)
        if now == self._file:
            return conn
        if now is not None:
            self.available = False
            self._replaced = True
            log.error(
                "DLQ file %s was replaced by another file while in use; the DLQ takes no more "
                "records until a restart opens it (the records it held stay in the open file "
                "until then)",
                self.path,
            )
            raise DlqUnavailable("the DLQ file was replaced while in use")
        try:
            fresh = self._recreate(conn)
        except (sqlite3.Error, OSError) as exc:
            self.available = False
            log.error(
                "DLQ file %s was deleted while in use and could not be written again: %s",
                self.path,
                exc,
            )
            raise DlqUnavailable(f"the DLQ file was deleted, not recreated: {exc}") from None
        self.recreated += 1
        self.available = True  # a copy that failed earlier left it unavailable meanwhile
        self.on_recreated()
        log.error(
            "DLQ file %s was deleted while in use; every record it held was written to a new "
            "file at that path (%d times so far)",
            self.path,
            self.recreated,
        )
        return fresh

    def _recreate(self, old: sqlite3.Connection) -> sqlite3.Connection:
        """Copy the open (deleted) database into a new file and link it in at the path; the
        old connections are closed only once the new file is in place."""
        tmp = f"{self.path}.restoring"
        for suffix in ("", "-journal", *schema.SUFFIXES[1:]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp + suffix)
        try:
            schema.prepare_private_file(tmp)
            copy = sqlite3.connect(tmp)
            try:
                old.backup(copy)
            finally:
                copy.close()
            os.link(tmp, self.path)  # never over a file someone put there meanwhile
        finally:
            for suffix in ("", "-journal", *schema.SUFFIXES[1:]):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp + suffix)
        _sync_directory(self.path)
        with self._read_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        old.close()
        fresh = self._connect()
        try:
            self._file = _identity(self.path)
            self._recount(fresh)
            reader = self._connect()
        except BaseException:
            fresh.close()
            raise
        with self._read_lock:
            self._reader = reader
        return fresh

    def close(self) -> None:
        if self._writer is not None:
            self._writer.stop()
            self._writer = None
        with self._read_lock:  # not under a read running in a worker thread
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        self.available = False

    # -- what the writer thread keeps up to date -------------------------------------------

    def _recount(self, conn: sqlite3.Connection) -> None:
        """Counts from the file itself: also what other processes sharing it wrote."""
        by_status: dict[str, int] = {}
        held_records = held_bytes = 0
        for status, n, b in conn.execute(
            "SELECT status, COUNT(*), COALESCE(SUM(size), 0) FROM records GROUP BY status"
        ):
            by_status[status] = n
            if status != "delivered":
                held_records += n
                held_bytes += b
        self.held_records, self.held_bytes, self._by_status = held_records, held_bytes, by_status
        self._publish(conn)

    def _publish(self, conn: sqlite3.Connection) -> None:
        row = conn.execute(
            "SELECT created_at FROM records WHERE status = 'pending' ORDER BY seq LIMIT 1"
        ).fetchone()
        self.counts = Counts(dict(self._by_status), float(row[0]) if row else None)

    def _committed(self, conn: sqlite3.Connection, delta: Delta) -> None:
        self._apply_delta(delta)
        self._publish(conn)

    def _apply_delta(self, delta: Delta) -> None:
        self.held_records += delta.get("records", 0)
        self.held_bytes += delta.get("bytes", 0)
        by_status = dict(self._by_status)
        for k, v in delta.items():
            if k.startswith("status:"):
                s = k[7:]
                by_status[s] = by_status.get(s, 0) + v
        self._by_status = by_status

    def _enqueue(self, fn: Operation) -> asyncio.Future[Any]:
        if not self.available or self._writer is None:
            raise DlqUnavailable("the DLQ is not open")
        return self._writer.submit(fn)

    async def _submit(self, fn: Operation) -> Any:
        return await self._enqueue(fn)

    # -- writes ----------------------------------------------------------------------------

    async def add(self, rec: NewRecord) -> str:
        """Store durably; returns the id after the commit. Raises DlqFull or DlqUnavailable."""
        size = rec.size

        def insert(conn: sqlite3.Connection, delta: Delta) -> str:
            if self.held_records + delta["records"] + 1 > self.max_records:
                raise DlqFull(f"the DLQ holds {self.max_records} records already")
            if self.held_bytes + delta["bytes"] + size > self.max_bytes:
                raise DlqFull(f"the DLQ holds {self.max_bytes} bytes already")
            values = (
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
                1 if rec.reached_upstream else 0,
            )
            for tries_left in range(ID_TRIES - 1, -1, -1):
                rid = new_id(rec.created_at)
                try:
                    conn.execute(INSERT, (rid, *values))
                    break
                except sqlite3.IntegrityError:
                    # The same id in the same millisecond (32 random bits): draw again. Only
                    # this statement was undone; raising would refuse the whole group.
                    if tries_left == 0:
                        raise
            delta["records"] += 1
            delta["bytes"] += size
            _move(delta, None, "pending")
            return rid

        result: str = await self._submit(insert)
        return result

    def claim(
        self, rid: str, owner: str, statuses: Iterable[str], lease: float, now: float
    ) -> asyncio.Future[dict[str, Any]]:
        """Take the replay claim of one record, atomically in the file; the future gives the
        record (with headers and body) as claimed. The claim commits even if nobody awaits the
        future any more: a caller that is cancelled must give back what it was granted.

        Granted only when the record's status is one of ``statuses`` and nobody holds an
        unexpired claim. Otherwise raises RecordNotFound, RecordDelivered, RecordBusy or
        RecordNotInStatus and changes nothing. Taking over an expired claim (its holder died)
        marks the record as possibly having reached the upstream.
        """
        wanted = tuple(s for s in statuses if s != "delivered")
        marks = ", ".join("?" for _ in wanted)

        def take(conn: sqlite3.Connection, delta: Delta) -> dict[str, Any]:
            cur = conn.execute(
                "UPDATE records SET "
                "reached_upstream = CASE WHEN claimed_by IS NOT NULL THEN 1 "
                "ELSE reached_upstream END, "
                "claimed_by = ?, claimed_at = ?, claim_expires_at = ? "
                f"WHERE id = ? AND status IN ({marks}) "
                "AND (claimed_by IS NULL OR claim_expires_at <= ?)",
                (owner, now, now + lease, rid, *wanted, now),
            )
            if cur.rowcount == 1:
                row = conn.execute(
                    f"SELECT {COLUMNS}, headers, body FROM records WHERE id = ?", (rid,)
                ).fetchone()
                return _full(row)
            row = conn.execute(
                "SELECT status, claimed_by, claim_expires_at FROM records WHERE id = ?", (rid,)
            ).fetchone()
            if row is None:
                raise RecordNotFound(f"no DLQ record {rid}")
            status, holder, expires = row
            if status == "delivered":
                raise RecordDelivered(f"record {rid} was delivered already; it is not sent again")
            if holder is not None and expires is not None and expires > now:
                raise RecordBusy(
                    f"record {rid} is being replayed already (by {holder}, "
                    f"claim expires in {expires - now:.0f}s)"
                )
            raise RecordNotInStatus(f"record {rid} is {status}, not {' or '.join(wanted)}")

        return self._enqueue(take)

    def _finish_op(self, rid: str, owner: str, fin: Finish, now: float) -> Operation:
        def update(conn: sqlite3.Connection, delta: Delta) -> bool:
            row = conn.execute(
                "SELECT status, size FROM records WHERE id = ? AND claimed_by = ?", (rid, owner)
            ).fetchone()
            if row is None:
                return False  # purged, or the claim expired and someone else took it
            old, size = row
            conn.execute(
                "UPDATE records SET status = ?, replays = replays + ?, last_status = ?, "
                "last_error = ?, updated_at = ?, "
                "reached_upstream = CASE WHEN ? THEN 1 ELSE reached_upstream END, "
                "parked_reason = ?, claimed_by = NULL, claimed_at = NULL, "
                "claim_expires_at = NULL WHERE id = ? AND claimed_by = ?",
                (
                    fin.status,
                    1 if fin.count_replay else 0,
                    fin.last_status,
                    fin.last_error,
                    now,
                    1 if fin.reached else 0,
                    fin.parked_reason if fin.status == "parked" else None,
                    rid,
                    owner,
                ),
            )
            if old != fin.status:
                _move(delta, old, fin.status)
                if fin.status == "delivered":
                    delta["records"] -= 1
                    delta["bytes"] -= size
            return True

        return update

    async def finish(self, rid: str, owner: str, fin: Finish, now: float) -> bool:
        """Record a claimed replay's outcome and give the claim back. False when the claim was
        no longer ours (it expired and was taken over, or the record was purged)."""
        ok: bool = await self._submit(self._finish_op(rid, owner, fin, now))
        return ok

    def release_soon(self, rid: str, owner: str, reached: bool) -> None:
        """Give a claim back without awaiting the commit: for a replay that was cancelled
        half-way (its task may be cancelled again before an await returns). Queued in order
        behind everything else; if the write fails the claim simply expires."""

        def release(conn: sqlite3.Connection, delta: Delta) -> bool:
            cur = conn.execute(
                "UPDATE records SET claimed_by = NULL, claimed_at = NULL, "
                "claim_expires_at = NULL, "
                "reached_upstream = CASE WHEN ? THEN 1 ELSE reached_upstream END "
                "WHERE id = ? AND claimed_by = ?",
                (1 if reached else 0, rid, owner),
            )
            return cur.rowcount == 1

        try:
            fut = self._enqueue(release)
        except DlqUnavailable:
            return
        fut.add_done_callback(_log_release)

    async def delete(self, rid: str, now: float | None = None) -> bool:
        """Purge one record; refused with RecordBusy while a replay holds its claim."""
        at = time.time() if now is None else now

        def remove(conn: sqlite3.Connection, delta: Delta) -> bool:
            row = conn.execute(
                "SELECT status, size, claimed_by, claim_expires_at FROM records WHERE id = ?",
                (rid,),
            ).fetchone()
            if row is None:
                return False
            status, size, holder, expires = row
            if holder is not None and expires is not None and expires > at:
                raise RecordBusy(f"record {rid} is being replayed (by {holder})")
            conn.execute("DELETE FROM records WHERE id = ?", (rid,))
            _move(delta, status, None)
            if status != "delivered":
                delta["records"] -= 1
                delta["bytes"] -= size
            return True

        ok: bool = await self._submit(remove)
        return ok

    async def prune_delivered(self, older_than: float) -> int:
        def prune(conn: sqlite3.Connection, delta: Delta) -> int:
            cur = conn.execute(
                "DELETE FROM records WHERE status = 'delivered' AND updated_at < ?", (older_than,)
            )
            delta["status:delivered"] = delta.get("status:delivered", 0) - cur.rowcount
            return cur.rowcount

        n: int = await self._submit(prune)
        return n

    # -- reads (a separate connection; WAL lets it read while the writer writes) -----------

    def _read(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        with self._read_lock:  # close() takes it too: the reader is not closed mid-read
            reader = self._reader
            if reader is None:
                raise DlqUnavailable("the DLQ is not open")
            try:
                return reader.execute(sql, args).fetchall()
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
        return _full(rows[0])


def _move(delta: Delta, old: str | None, new: str | None) -> None:
    if old is not None:
        delta[f"status:{old}"] = delta.get(f"status:{old}", 0) - 1
    if new is not None:
        delta[f"status:{new}"] = delta.get(f"status:{new}", 0) + 1


def _summary(r: tuple[Any, ...]) -> dict[str, Any]:
    reached = r[15]
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
        "reached_upstream": None if reached is None else bool(reached),
        "claimed_by": r[16],
        "claimed_at": r[17],
        "claim_expires_at": r[18],
        "parked_reason": r[19],
    }


def _full(r: tuple[Any, ...]) -> dict[str, Any]:
    out = _summary(r[:_NCOLS])
    out["headers"] = [list(h) for h in json.loads(r[_NCOLS])]
    out["body_bytes"] = bytes(r[_NCOLS + 1])
    return out


def _log_release(fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.warning("giving back a DLQ replay claim failed (it will expire): %s", exc)


CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB: the file itself is damaged


def damaged(exc: sqlite3.Error) -> bool:
    """The error says the file is not a sound database (extended codes keep the primary code
    in their low byte); anything else is about the disk, a lock or the process."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in CORRUPT_CODES


def _identity(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _sync_directory(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _locked(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the file for now."""
    text = str(exc).lower()
    return "locked" in text or "busy" in text

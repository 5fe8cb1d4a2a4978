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
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from sidecar.dlq import dbfile, operations, schema
from sidecar.dlq.contract import Ids, RouteCounts
from sidecar.dlq.counts import Counts
from sidecar.dlq.errors import DlqUnavailable
from sidecar.dlq.operations import Finish
from sidecar.dlq.record import NewRecord
from sidecar.dlq.rows import COLUMNS, full, summary
from sidecar.dlq.tally import StoreTally
from sidecar.dlq.writer import GroupWriter, Operation

log = logging.getLogger("sidecar.dlq")

REFRESH_EVERY = 10.0  # seconds between full recounts of the file (other processes' writes)


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
        self._tally = StoreTally()
        self.corrupt_moved_to: str | None = None
        self.available = False
        self._file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file opened
        self.recreated = 0  # times the file was found deleted and written anew (writer thread)
        self._replaced = False  # another file was put at the path: never written to
        # Told (from the writer thread) each time the file was recreated; the app counts it.
        self.on_recreated: Callable[[], None] = lambda: None

    @property
    def counts(self) -> Counts:
        return self._tally.counts

    @property
    def location(self) -> str:
        return self.path

    @property
    def by_status(self) -> dict[str, int]:
        return self._tally.counts.by_status

    @property
    def held_records(self) -> int:
        return self._tally.held_records

    @property
    def held_bytes(self) -> int:
        return self._tally.held_bytes

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
                if not dbfile.locked(exc) or time.monotonic() + delay > give_up:
                    raise
            time.sleep(delay)  # a worker thread: the event loop is not blocked
            delay = min(delay * 2, 0.2)

    def _open_once(self) -> None:
        if os.path.exists(self.path) and not dbfile.healthy(self.path):
            self.corrupt_moved_to = dbfile.move_aside(self.path)
        schema.prepare_private_file(self.path)
        writer = self._connect()
        try:
            schema.migrate(writer)
            self._file = dbfile.identity(self.path)
            self._tally.recount(writer)
            self._reader = self._connect()
        except BaseException:
            writer.close()
            raise
        self._writer = GroupWriter(
            writer,
            self._tally.committed,
            self._tally.recount,
            lambda: REFRESH_EVERY,
            self._still_ours,
        )
        self._writer.start()
        self.available = True

    def _connect(self) -> sqlite3.Connection:
        return dbfile.connect(self.path, self._busy_timeout_ms, self._max_page_count)

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
        now = dbfile.identity(self.path)
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
        dbfile.copy_to_path(old, self.path)
        with self._read_lock:
            if self._reader is not None:
                self._reader.close()
                self._reader = None
        old.close()
        fresh = self._connect()
        try:
            self._file = dbfile.identity(self.path)
            self._tally.recount(fresh)
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

    # -- writes (each an operation of ``operations``, run by the writer thread) -----------

    def _enqueue(self, fn: Operation) -> asyncio.Future[Any]:
        if not self.available or self._writer is None:
            raise DlqUnavailable("the DLQ is not open")
        return self._writer.submit(fn)

    async def _submit(self, fn: Operation) -> Any:
        return await self._enqueue(fn)

    async def add(self, rec: NewRecord) -> str:
        """Store durably; returns the id after the commit. Raises DlqFull or DlqUnavailable."""
        result: str = await self._submit(operations.insert(rec, self))
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
        return self._enqueue(operations.take_claim(rid, owner, statuses, lease, now))

    async def finish(self, rid: str, owner: str, fin: Finish, now: float) -> bool:
        """Record a claimed replay's outcome and give the claim back. False when the claim was
        no longer ours (it expired and was taken over, or the record was purged)."""
        ok: bool = await self._submit(operations.finish(rid, owner, fin, now))
        return ok

    def release_soon(self, rid: str, owner: str, reached: bool) -> None:
        """Give a claim back without awaiting the commit: for a replay that was cancelled
        half-way (its task may be cancelled again before an await returns). Queued in order
        behind everything else; if the write fails the claim simply expires."""
        try:
            fut = self._enqueue(operations.release(rid, owner, reached))
        except DlqUnavailable:
            return
        fut.add_done_callback(_log_release)

    async def delete(self, rid: str, now: float | None = None) -> bool:
        """Purge one record; refused with RecordBusy while a replay holds its claim."""
        at = time.time() if now is None else now
        ok: bool = await self._submit(operations.remove(rid, at))
        return ok

    async def prune_delivered(self, older_than: float) -> int:
        n: int = await self._submit(operations.prune(older_than))
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
        out = [summary(r) for r in rows[:limit]]
        nxt = rows[limit - 1][0] if len(rows) > limit else None
        return out, nxt

    async def get(self, rid: str) -> dict[str, Any] | None:
        rows = await asyncio.to_thread(
            self._read, f"SELECT {COLUMNS}, headers, body FROM records WHERE id = ?", (rid,)
        )
        if not rows:
            return None
        return full(rows[0])

    async def due(self, route: str, limit: int, idle: float) -> Ids:
        rows, _ = await self.list(route=route, status="pending", limit=limit, newest_first=False)
        return [r["id"] for r in rows]

    async def route_counts(self) -> RouteCounts:
        """One grouped read on the reader connection, in a thread, never on the loop."""
        return await asyncio.to_thread(self._route_counts)

    def _route_counts(self) -> RouteCounts:
        """The first query is answered from the (status, route, seq) index; the second reads
        one row per group (seq grows with time)."""
        groups = self._read(_COUNTS, ())
        if not groups:
            return []
        seqs = tuple(g[3] for g in groups)
        marks = ",".join("?" * len(seqs))
        sql = f"SELECT seq, created_at FROM records WHERE seq IN ({marks})"
        created = dict(self._read(sql, seqs))
        return [(g[0], g[1], int(g[2]), float(created.get(g[3], 0.0))) for g in groups]


_COUNTS = (
    "SELECT status, route, COUNT(*), MIN(seq) FROM records "
    "WHERE status IN ('pending', 'parked') GROUP BY status, route"
)


def _log_release(fut: asyncio.Future[Any]) -> None:
    if fut.cancelled():
        return
    exc = fut.exception()
    if exc is not None:
        log.warning("giving back a DLQ replay claim failed (it will expire): %s", exc)

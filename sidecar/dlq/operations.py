"""The DLQ's writes, each an operation the writer thread runs inside a group's transaction
(``writer.Operation``: the connection and the group's delta in, a result or a refusal out):
storing a record within the bounds, taking and giving back a replay claim, a replay's outcome,
a purge and the pruning of delivered records. Each notes in the delta what it changed, so the
counts follow without a recount."""

from __future__ import annotations

import json
import secrets
import sqlite3
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.dlq.errors import (
    DlqFull,
    RecordBusy,
    RecordDelivered,
    RecordNotFound,
    RecordNotInStatus,
)
from sidecar.dlq.record import NewRecord
from sidecar.dlq.rows import COLUMNS, full
from sidecar.dlq.tally import move
from sidecar.dlq.writer import Delta, Operation

INSERT = (
    "INSERT INTO records (id, route, status, method, target, headers, body, fate, attempts, "
    "last_status, last_error, idempotency_key, size, created_at, updated_at, reached_upstream) "
    "VALUES (?, ?, 'pending', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"
)
ID_TRIES = 5


class Holding(Protocol):
    """What a new record is measured against, read in the writer thread when it is stored."""

    @property
    def held_records(self) -> int: ...
    @property
    def held_bytes(self) -> int: ...
    @property
    def max_records(self) -> int: ...
    @property
    def max_bytes(self) -> int: ...


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


def insert(rec: NewRecord, held: Holding) -> Operation:
    """Store ``rec`` as pending; refused with DlqFull past the bounds. Gives its id."""
    size = rec.size

    def run(conn: sqlite3.Connection, delta: Delta) -> str:
        if held.held_records + delta["records"] + 1 > held.max_records:
            raise DlqFull(f"the DLQ holds {held.max_records} records already")
        if held.held_bytes + delta["bytes"] + size > held.max_bytes:
            raise DlqFull(f"the DLQ holds {held.max_bytes} bytes already")
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
        move(delta, None, "pending")
        return rid

    return run


def take_claim(
    rid: str, owner: str, statuses: Iterable[str], lease: float, now: float
) -> Operation:
    """The compare-and-set of ``DlqStore.claim``: gives the record as claimed, or raises."""
    wanted = tuple(s for s in statuses if s != "delivered")
    marks = ", ".join("?" for _ in wanted)

    def run(conn: sqlite3.Connection, delta: Delta) -> dict[str, Any]:
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
            return full(row)
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

    return run


def finish(rid: str, owner: str, fin: Finish, now: float) -> Operation:
    """A claimed replay's outcome, the claim given back; False when it was no longer ours."""

    def run(conn: sqlite3.Connection, delta: Delta) -> bool:
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
            move(delta, old, fin.status)
            if fin.status == "delivered":
                delta["records"] -= 1
                delta["bytes"] -= size
        return True

    return run


def release(rid: str, owner: str, reached: bool) -> Operation:
    """A claim given back without an outcome (a replay cancelled half-way)."""

    def run(conn: sqlite3.Connection, delta: Delta) -> bool:
        cur = conn.execute(
            "UPDATE records SET claimed_by = NULL, claimed_at = NULL, "
            "claim_expires_at = NULL, "
            "reached_upstream = CASE WHEN ? THEN 1 ELSE reached_upstream END "
            "WHERE id = ? AND claimed_by = ?",
            (1 if reached else 0, rid, owner),
        )
        return cur.rowcount == 1

    return run


def remove(rid: str, at: float) -> Operation:
    """Purge one record; RecordBusy while an unexpired claim holds it."""

    def run(conn: sqlite3.Connection, delta: Delta) -> bool:
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
        move(delta, status, None)
        if status != "delivered":
            delta["records"] -= 1
            delta["bytes"] -= size
        return True

    return run


def prune(older_than: float) -> Operation:
    """Delete the delivered records last updated before ``older_than``; gives how many."""

    def run(conn: sqlite3.Connection, delta: Delta) -> int:
        cur = conn.execute(
            "DELETE FROM records WHERE status = 'delivered' AND updated_at < ?", (older_than,)
        )
        delta["status:delivered"] = delta.get("status:delivered", 0) - cur.rowcount
        return cur.rowcount

    return run

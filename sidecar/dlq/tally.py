"""What the DLQ holds, counted: kept (pending + parked) records and bytes, which bound new
records, and the counts by status with the oldest pending record, which the gauges show.

Written only by the writer thread: from the file itself (``recount``, which also sees what
other processes sharing the file wrote) and from what each committed group changed
(``committed``). The loop only reads ``counts``, replaced whole.
"""

from __future__ import annotations

import sqlite3

from sidecar.dlq.counts import Counts
from sidecar.dlq.writer import Delta

__all__ = ["Counts", "StoreTally", "move"]


def move(delta: Delta, old: str | None, new: str | None) -> None:
    """Note in a group's delta that one record went from status ``old`` to ``new`` (None:
    it did not exist before / does not any more)."""
    if old is not None:
        delta[f"status:{old}"] = delta.get(f"status:{old}", 0) - 1
    if new is not None:
        delta[f"status:{new}"] = delta.get(f"status:{new}", 0) + 1


class StoreTally:
    def __init__(self) -> None:
        self.held_records = 0
        self.held_bytes = 0
        self._by_status: dict[str, int] = {}
        self.counts = Counts()

    def recount(self, conn: sqlite3.Connection) -> None:
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

    def committed(self, conn: sqlite3.Connection, delta: Delta) -> None:
        self._apply(delta)
        self._publish(conn)

    def _publish(self, conn: sqlite3.Connection) -> None:
        row = conn.execute(
            "SELECT created_at FROM records WHERE status = 'pending' ORDER BY seq LIMIT 1"
        ).fetchone()
        self.counts = Counts(dict(self._by_status), float(row[0]) if row else None)

    def _apply(self, delta: Delta) -> None:
        self.held_records += delta.get("records", 0)
        self.held_bytes += delta.get("bytes", 0)
        by_status = dict(self._by_status)
        for k, v in delta.items():
            if k.startswith("status:"):
                s = k[7:]
                by_status[s] = by_status.get(s, 0) + v
        self._by_status = by_status

"""Per-route DLQ figures for the status page: pending and parked counts and the oldest record's
age. One grouped read on the store's reader connection, in a thread, never on the loop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sidecar.dlq.errors import DlqError

if TYPE_CHECKING:
    # The store (and sqlite3 with it) is loaded only when a DLQ opens: a type here, nothing more.
    from sidecar.dlq.store import DlqStore

_COUNTS = (
    "SELECT status, route, COUNT(*), MIN(seq) FROM records "
    "WHERE status IN ('pending', 'parked') GROUP BY status, route"
)


def read(store: DlqStore) -> list[tuple[str, str, int, float]]:
    """(status, route, count, oldest created_at). The first query is answered from the
    (status, route, seq) index; the second reads one row per group (seq grows with time)."""
    groups = store._read(_COUNTS, ())
    if not groups:
        return []
    seqs = tuple(g[3] for g in groups)
    marks = ",".join("?" * len(seqs))
    created = dict(store._read(f"SELECT seq, created_at FROM records WHERE seq IN ({marks})", seqs))
    return [(g[0], g[1], int(g[2]), float(created.get(g[3], 0.0))) for g in groups]


class DlqFigures:
    """What the status page reads of the DLQ (``sidecar.admin.snapshot.DlqView``)."""

    def __init__(self, store: Callable[[], DlqStore | None]) -> None:
        self._store = store

    def is_open(self) -> bool:
        store = self._store()
        return store is not None and store.available

    async def per_route(self, wall: float) -> dict[str, dict[str, Any]]:
        """route -> {"pending": n, "parked": n, "pending_age": s, "parked_age": s}; {} when
        no DLQ is open or it cannot be read."""
        store = self._store()
        if store is None or not store.available:
            return {}
        try:
            rows = await asyncio.to_thread(read, store)
        except DlqError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for status, route, count, created in rows:
            d = out.setdefault(route, {})
            d[status] = count
            d[f"{status}_age"] = max(0.0, wall - created)
        return out

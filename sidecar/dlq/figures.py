"""Per-route DLQ figures for the status page: pending and parked counts and the oldest record's
age, and where the records are kept. Read from the open store (``contract.DlqStorage``): the
SQLite file in a thread, never on the loop; the fleet's Redis within its timeout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sidecar.dlq.contract import DlqStorage
from sidecar.dlq.errors import DlqError


class DlqFigures:
    """What the status page reads of the DLQ (``sidecar.admin.snapshot.DlqView``)."""

    def __init__(
        self,
        store: Callable[[], DlqStorage | None],
        location: Callable[[], str],
        warning: Callable[[], str | None] = lambda: None,
    ) -> None:
        self._store = store
        self._location = location
        self._warning = warning

    def is_open(self) -> bool:
        store = self._store()
        return store is not None and store.available

    def location(self) -> str:
        return self._location()

    def warning(self) -> str | None:
        """What the start-up check of the store found wrong (a Redis without ``appendfsync
        always``), or None."""
        return self._warning()

    async def per_route(self, wall: float) -> dict[str, dict[str, Any]]:
        """route -> {"pending": n, "parked": n, "pending_age": s, "parked_age": s}; {} when
        no DLQ is open or it cannot be read."""
        store = self._store()
        if store is None or not store.available:
            return {}
        try:
            rows = await store.route_counts()
        except DlqError:
            return {}
        out: dict[str, dict[str, Any]] = {}
        for status, route, count, created in rows:
            d = out.setdefault(route, {})
            d[status] = count
            d[f"{status}_age"] = max(0.0, wall - created)
        return out

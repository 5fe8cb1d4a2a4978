"""The DLQ store's contract: what the capture, the replayer, the redrive, the admin endpoints,
the status page's figures and the gauges call, which both backends satisfy -- the SQLite file
(``store.DlqStore``) and the fleet's Redis (``redisstore.RedisDlqStore``). Strict mypy checks
each against it (``app`` and the tests hand either one where a ``DlqStorage`` is asked for).

The same rules hold on both: ``add`` answers only once the record is durable (committed, or
confirmed by Redis), and refuses with ``DlqFull`` past ``max_records``/``max_bytes`` of pending
and parked records or ``DlqUnavailable`` when the storage fails; a claim is a compare-and-set on
status and claim, one holder at a time, a lease that anyone may take over once it expired (the
record then counts as possibly having reached the upstream); ``finish`` and ``release_soon``
take effect only for the claim's holder; a purge is refused while an unexpired claim holds the
record. Times passed in (``now``) are the caller's wall clock; the Redis store judges leases on
Redis's own clock instead (``TIME``), so replicas need not agree on theirs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Protocol

from sidecar.dlq.counts import Counts

if TYPE_CHECKING:
    # Types only: the contract is imported at start, the backends (and sqlite3 or redis)
    # only when a DLQ opens.
    from sidecar.dlq.operations import Finish
    from sidecar.dlq.record import NewRecord


# (status, route, count, oldest created_at) for the pending and parked records of each route
RouteCounts = list[tuple[str, str, int, float]]
Ids = list[str]  # record ids


class DlqStorage(Protocol):
    @property
    def available(self) -> bool:
        """Whether the store takes records now (the ``dlq_available`` gauge)."""
        ...

    @property
    def counts(self) -> Counts:
        """What the gauges show, as last published: a scrape never queries the store."""
        ...

    @property
    def location(self) -> str:
        """Where the records are, for the status page (a path, or the Redis and its keys)."""
        ...

    def set_limits(self, max_records: int, max_bytes: int) -> None: ...

    async def add(self, rec: NewRecord) -> str: ...

    def claim(
        self, rid: str, owner: str, statuses: Iterable[str], lease: float, now: float
    ) -> asyncio.Future[dict[str, Any]]:
        """Runs to its end whether or not the caller still awaits it (a cancelled caller must
        give back what it was granted)."""
        ...

    async def finish(self, rid: str, owner: str, fin: Finish, now: float) -> bool: ...

    def release_soon(self, rid: str, owner: str, reached: bool) -> None: ...

    async def delete(self, rid: str, now: float | None = None) -> bool: ...

    async def prune_delivered(self, older_than: float) -> int: ...

    async def list(
        self,
        route: str | None = None,
        status: str | None = None,
        limit: int = 50,
        newest_first: bool = True,
        cursor: int | None = None,
    ) -> tuple[list[dict[str, Any]], int | None]: ...

    async def get(self, rid: str) -> dict[str, Any] | None: ...

    async def due(self, route: str, limit: int, idle: float) -> Ids:
        """The ids of the route's pending records the redrive of this process looks at now,
        oldest first. ``idle``: the claim lease, after which work another process took and
        left (it died) is this one's to take over (the SQLite file has no such list: every
        process looks at every pending record)."""
        ...

    async def route_counts(self) -> RouteCounts: ...

"""Whether the fleet's Redis may evict keys: ``maxmemory-policy`` and ``maxmemory``, read with
``CONFIG GET`` at start by each use that keeps data there (the idempotency keys, the DLQ), as
``fleet.aof`` reads the append-only settings.

With ``noeviction`` a full Redis refuses writes (``OOM``), which the uses see as a store error:
a guarded write follows its route's ``on_store_error``, a DLQ record is refused. With any other
policy (``allkeys-*``, ``volatile-*``: the sidecar's keys carry a TTL, so ``volatile-*`` may pick
them too) a full Redis deletes keys instead: an evicted kept answer or in-progress claim lets a
duplicate run the write again; an evicted DLQ record is lost. That is a warning, not a refusal:
the sidecar runs, and says so in a log line, on the status page and in ``GET /status``. A Redis
that refuses ``CONFIG`` (a managed one) is "unknown", also a warning, never fatal.
"""

from __future__ import annotations

from collections.abc import Mapping

from sidecar.fleet.aof import config_get
from sidecar.fleet.connection import FleetLink

WANTED = "noeviction"
# What an eviction means, by use (the link's use name).
EVICTED = {
    "idempotency": (
        "a kept answer or an in-progress claim evicted lets a duplicate run the write again"
    ),
    "dlq": "a DLQ record evicted is lost",
}


def judge(settings: Mapping[str, str], use: str) -> str | None:
    """The warning for what ``CONFIG GET maxmemory*`` answered, or None when Redis never
    evicts. Pure."""
    policy = settings.get("maxmemory-policy")
    if policy == WANTED:
        return None
    limit = settings.get("maxmemory", "unknown")
    when = "once it reaches it" if limit not in ("0", "unknown") else "if a maxmemory is set"
    return (
        f"the fleet Redis runs with maxmemory-policy {policy or 'unknown'} (maxmemory {limit}): "
        f"it may evict keys {when}; {EVICTED[use]}; run it with maxmemory-policy noeviction "
        "(a full Redis then refuses writes: a store error, on_store_error applies)"
    )


def cannot_check(reason: str, use: str) -> str:
    return (
        f"cannot check the fleet Redis's maxmemory-policy (CONFIG GET: {reason}): unknown; make "
        f"sure it is noeviction, or keys may be evicted: {EVICTED[use]}"
    )


async def check(link: FleetLink, use: str) -> str | None:
    """The warning for the Redis's eviction settings, or None; raises ``FleetUnavailable``
    when it cannot be reached, so the caller asks again later."""
    got = await config_get(link, "maxmemory*")
    return cannot_check(got, use) if isinstance(got, str) else judge(got, use)

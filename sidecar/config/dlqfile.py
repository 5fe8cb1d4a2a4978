"""The top-level ``dlq:`` section: where the DLQ keeps its records, and their bounds. Declared
once here (``sidecar/config/schema.py``); ``sidecar/dlq`` reads it.

``backend: sqlite`` (the default) keeps them in the file at ``path``; ``backend: redis`` in the
fleet's Redis (``fleet.redis``, one stream per route), valid only with ``fleet.redis.url``.
``max_records`` and ``max_bytes`` bound what is kept (pending and parked), fleet-wide with
Redis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sidecar.config import checks as c
from sidecar.config.fleet import Fleet
from sidecar.config.schema import key

# redis: the fleet's shared DLQ; valid only with fleet.redis.url
DlqBackend = Literal["sqlite", "redis"]
DLQ_BACKENDS: tuple[DlqBackend, ...] = ("sqlite", "redis")


@dataclass(frozen=True, slots=True)
class DlqFile:
    # The open store is not swapped under in-flight writes (backend and path are read at
    # start); the bounds apply to the next record.
    backend: DlqBackend = key(
        "sqlite",
        c.Choice(DLQ_BACKENDS),
        live=False,
        note="sqlite: the file at path; redis: fleet.redis, one stream per route",
    )
    path: str = key("./data/dlq.sqlite3", c.non_empty_str, live=False)
    max_records: int = key(100_000, c.int_range(1, 100_000_000))
    max_bytes: int = key(1024**3, c.size, unit="size")


def dlq_problems(dlq: DlqFile, fleet: Fleet) -> list[tuple[str, str]]:
    """What the top-level ``dlq:`` asks of ``fleet:``, as (key of ``dlq``, message)."""
    if dlq.backend == "redis" and fleet.redis.url is None:
        needs = "redis needs fleet.redis.url: the records are kept in the fleet's Redis"
        return [("backend", needs)]
    return []

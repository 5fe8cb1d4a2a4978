"""What a row of the DLQ's ``records`` table reads as: the columns every listing selects, and
the dict a record is handed out as (its summary, or in full with its headers and body)."""

from __future__ import annotations

import json
from typing import Any

COLUMNS = (
    "seq, id, route, status, method, target, fate, attempts, last_status, last_error, "
    "idempotency_key, replays, size, created_at, updated_at, reached_upstream, claimed_by, "
    "claimed_at, claim_expires_at, parked_reason"
)
NCOLS = COLUMNS.count(",") + 1


def summary(r: tuple[Any, ...]) -> dict[str, Any]:
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


def full(r: tuple[Any, ...]) -> dict[str, Any]:
    """A row of ``COLUMNS, headers, body``."""
    out = summary(r[:NCOLS])
    out["headers"] = [list(h) for h in json.loads(r[NCOLS])]
    out["body_bytes"] = bytes(r[NCOLS + 1])
    return out

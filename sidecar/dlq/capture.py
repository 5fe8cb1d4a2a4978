"""Deciding and storing a failed write on its way back to the client."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.config.model import Route
from sidecar.core import Fate
from sidecar.dlq.record import WRITE_METHODS, NewRecord, storable_headers, transient_failure
from sidecar.dlq.store import DlqError, DlqStore


@dataclass(frozen=True, slots=True)
class Captured:
    header: str  # the x-retry-dlq value: stored | full | unavailable | body-too-large
    record_id: str | None = None


OnWrite = Callable[[str, str], None]  # (route, result)


async def capture(
    store: DlqStore | None,
    route: Route,
    method: str,
    target: str,
    headers: list[tuple[bytes, bytes]],
    body: bytes | None,
    fate: Fate,
    attempts: int,
    final_status: int | None,
    error: str | None,
    on_write: OnWrite,
) -> Captured | None:
    """Store the request if it is a write on a DLQ route that ended in a transient failure.

    Returns None when the DLQ does not apply; otherwise what the client is told. The record is
    durable on disk before this returns "stored".
    """
    if not route.dlq.enabled or method not in WRITE_METHODS:
        return None
    if not transient_failure(fate, final_status, error is not None):
        return None
    if body is None and fate is Fate.BODY_TOO_LARGE:
        on_write(route.name, "body-too-large")
        return Captured("body-too-large")
    if store is None:
        on_write(route.name, "unavailable")
        return Captured("unavailable")
    idem = None
    for k, v in headers:
        if k.lower() == b"idempotency-key":
            idem = v.decode("latin-1")
            break
    rec = NewRecord(
        route=route.name,
        method=method,
        target=target,
        headers=storable_headers(headers, route.dlq.keep_credentials),
        body=body or b"",
        fate=fate.value,
        attempts=attempts,
        last_status=final_status,
        last_error=error,
        idempotency_key=idem,
        created_at=time.time(),
    )
    try:
        rid = await store.add(rec)
    except DlqError as exc:
        on_write(route.name, exc.header)
        return Captured(exc.header)
    on_write(route.name, "stored")
    return Captured("stored", rid)

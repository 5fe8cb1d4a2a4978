"""Deciding and storing a failed write on its way back to the client."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.config.model import Route
from sidecar.core import Fate
from sidecar.dlq.errors import DlqError
from sidecar.dlq.record import (
    WRITE_METHODS,
    KeptBody,
    NewRecord,
    idempotency_key,
    storable_headers,
    transient_failure,
)
from sidecar.engine.loop import SequenceResult

if TYPE_CHECKING:
    # A store is loaded only when a DLQ opens: a type here, nothing more.
    from sidecar.dlq.contract import DlqStorage


@dataclass(frozen=True, slots=True)
class Captured:
    header: str  # the x-retry-dlq value: stored | full | unavailable | body-too-large
    record_id: str | None = None


OnWrite = Callable[[str, str], None]  # (route, result)


def reached_upstream(result: SequenceResult | None) -> bool:
    """Whether any byte of the request may have reached the upstream during the sequence.

    No when the breaker refused it (``result`` None), or when every attempt failed before
    sending (connect failures, refusals in the sidecar, no time left): the sequence knows
    which of its attempts came back having sent bytes (``SequenceResult.reached``).
    """
    if result is None:
        return False
    if result.response is not None or result.error is None:
        return True
    return result.reached or result.error.reached_upstream


async def capture(
    store: DlqStorage | None,
    route: Route,
    method: str,
    target: str,
    headers: list[tuple[bytes, bytes]],
    body: KeptBody,
    *,
    fate: Fate,
    attempts: int,
    final_status: int | None,
    error: str | None,
    on_write: OnWrite,
    result: SequenceResult | None,
) -> Captured | None:
    """Store the request if it is a write on a DLQ route that ended in a transient failure.

    ``result`` is the sequence's result (None when the breaker refused it). Returns None when
    the DLQ does not apply; otherwise what the client is told. The record is durable (committed
    to the file, or confirmed by Redis) before this returns "stored". A body that was streamed
    rather than held whole is never stored (``body-too-large``): the DLQ keeps the request
    exactly or not at all.
    """
    if not route.dlq.enabled or method not in WRITE_METHODS:
        return None
    if not transient_failure(fate, final_status, error is not None):
        return None
    if body.data is None:
        on_write(route.name, "body-too-large")
        return Captured("body-too-large")
    if store is None:
        on_write(route.name, "unavailable")
        return Captured("unavailable")
    key = idempotency_key(headers)
    rec = NewRecord(
        route=route.name,
        method=method,
        target=target,
        headers=storable_headers(headers, route.dlq.keep_credentials, route.dlq.drop_headers),
        body=body.data,
        fate=fate.value,
        attempts=attempts,
        last_status=final_status,
        last_error=error,
        idempotency_key=key,
        created_at=time.time(),
        reached_upstream=reached_upstream(result),
    )
    adding = asyncio.ensure_future(store.add(rec))
    try:
        rid = await asyncio.shield(adding)
    except asyncio.CancelledError:
        # The client left while the record was written: the writer thread goes on with it
        # whether or not anyone awaits it, so it is counted when it ends, not dropped uncounted.
        adding.add_done_callback(lambda done: _count(done, route.name, on_write))
        raise
    except DlqError as exc:
        on_write(route.name, exc.header)
        return Captured(exc.header)
    on_write(route.name, "stored")
    return Captured("stored", rid)


def _count(done: asyncio.Future[str], route: str, on_write: OnWrite) -> None:
    if done.cancelled():
        return
    exc = done.exception()
    if exc is None:
        on_write(route, "stored")
    elif isinstance(exc, DlqError):
        on_write(route, exc.header)

"""Expired keys pruned in the background: bounded batches, each one short transaction on the
event loop (well under a millisecond), the loop free between two of them."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sidecar.idempotency.store import IdempotencyStore, StoreError

log = logging.getLogger("sidecar.idempotency")

EVERY = 60.0  # seconds between passes
BATCH = 100  # keys deleted per transaction: about half a millisecond with small answers


async def prune_pass(store: IdempotencyStore, batch: int = BATCH) -> int:
    """Delete expired keys, ``batch`` at a time, until a batch comes back short; the number
    deleted. Other calls run between two batches."""
    total = 0
    while True:
        deleted = await store.prune(batch)
        total += deleted
        if deleted < batch:
            return total
        await asyncio.sleep(0)


async def prune_forever(
    store: IdempotencyStore,
    every: float = EVERY,
    batch: int = BATCH,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """The background task (``idempotency-prune``): a pass, then ``every`` seconds of sleep.
    A store error is logged and the next pass tries again."""
    while True:
        try:
            await prune_pass(store, batch)
        except StoreError as exc:
            log.warning("idempotency prune failed (tried again in %s s): %s", every, exc)
        await sleep(every)

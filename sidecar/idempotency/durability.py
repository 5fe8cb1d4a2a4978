"""Keys made durable in the background (the ``idempotency-sync`` task): the store commits on the
loop with ``synchronous=NORMAL`` (no fsync on the request path), and this task checkpoints the
WAL -- which fsyncs it -- in a worker thread every ``EVERY`` seconds after something was
written. A power loss may so roll back at most about the last ``EVERY`` seconds of keys; a crash
of the process rolls back nothing (the committed WAL is in the OS page cache). A checkpoint that
leaves the log past its bound is followed by ``reset_log``, which empties it (``sqlite.py``)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

from sidecar.idempotency.store import StoreError

log = logging.getLogger("sidecar.idempotency")

EVERY = 0.1  # seconds between two checkpoints, while keys are written


@runtime_checkable
class Checkpointed(Protocol):
    def take_written(self) -> bool:
        """Whether a write committed since the last call (and forget it); on the loop."""
        ...

    def checkpoint(self) -> bool:
        """Make every committed write durable; blocking, run in a worker thread; StoreError
        (the write is then still to be made durable) when it cannot. True when the log is
        left past its bound: ``reset_log`` next."""
        ...

    async def reset_log(self) -> None:
        """Empty the log, off the loop; StoreError when it cannot (tried after the next
        checkpoint again)."""
        ...


async def sync_forever(
    store: Checkpointed,
    every: float = EVERY,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Every ``every`` seconds: a checkpoint when something was written since the last one. A
    failed one is logged and tried again at the next tick. Cancelled (at stop), a checkpoint
    already running in its thread runs to its end; the store's ``close`` waits for it."""
    while True:
        await sleep(every)
        if not store.take_written():
            continue
        try:
            if await asyncio.to_thread(store.checkpoint):
                await store.reset_log()
        except StoreError as exc:
            log.warning("idempotency checkpoint failed (tried again in %s s): %s", every, exc)

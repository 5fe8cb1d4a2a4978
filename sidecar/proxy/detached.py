"""Guarded writes that outlive their client (nginx's ``proxy_ignore_client_abort on``, for the
writes a route guards with an Idempotency-Key).

A guarded write runs as a task of its own; its handler awaits it shielded. A client that leaves
cancels its handler, not the write: the exchange runs on to its end in the background, bounded by
the request's one deadline (``RequestContext.deadline``, counted from the end of its body, as the
sequence's) and a grace to settle its key after it: the sequence ends itself at the deadline (an
answer that releases the key), so the bound never cuts a write the app may still answer within
it. The guard settles its key by the app's answer, so the client's retry is
replayed (or gets 409 while it still runs) instead of running the write again. The tasks are held
here until done (a task nobody references may be collected mid-flight); at stop they get what is
left of the drain, like any request in flight, then are cancelled: the guard then leaves a key
whose request may have reached the app in progress until its lease, as a killed sidecar does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

from sidecar.config.idempotency import LEASE_MARGIN

T = TypeVar("T")
# Past the request's deadline, the time a write whose client left has to settle its key (the
# sequence ends itself at the deadline; the store call that settles the key is bounded by the
# store's own timeout). The lease's own margin, so the bound still falls within the lease.
SETTLE_GRACE = LEASE_MARGIN


class DetachedWrites:
    """The guarded writes in flight, whether their client is still there or not."""

    __slots__ = ("_tasks",)

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def start(self, work: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.get_running_loop().create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def bound(self, task: asyncio.Task[Any], left: float) -> None:
        """The client left: the write runs on for at most ``left`` (what is left of the
        request's deadline) plus ``SETTLE_GRACE``, then is cancelled."""
        if task.done():
            return
        handle = asyncio.get_running_loop().call_later(max(0.0, left) + SETTLE_GRACE, task.cancel)
        task.add_done_callback(lambda _: handle.cancel())

    async def stop(self, grace: float) -> None:
        """At stop: up to ``grace`` seconds (what is left of the drain) for the writes in flight
        to end, then the rest cancelled and awaited."""
        tasks = set(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, grace))
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)

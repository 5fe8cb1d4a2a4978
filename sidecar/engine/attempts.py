"""The attempts of one sequence that may run at the same time (a hedge races its original).

``async with AttemptSet() as attempts`` owns every attempt task it starts. ``next(timeout)``
hands back finished attempts one at a time, in the order they finished. Whatever way the scope
is left -- a winner returned, an exception, the client going away (cancellation), a second
cancellation while cleaning up -- every attempt still running is cancelled (the upstream client
then aborts its connection: a cancelled attempt's connection is closed, never pooled), and the
response of any attempt that finished but was not handed out is discarded. The discard is a
done-callback on each task, so it happens even if the cleanup itself is interrupted.

An attempt runs ``attempt_fn()``, which must turn every expected failure into a value (an
``Attempted`` with ``error`` set): an exception escaping it is a bug or a local error, and is
raised from ``next``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any

from sidecar.engine.attempted import Attempted

AttemptFn = Callable[[], Coroutine[Any, Any, Attempted]]


class AttemptSet:
    __slots__ = ("_closed", "_done", "_running")

    def __init__(self) -> None:
        self._running: set[asyncio.Task[Attempted]] = set()
        self._done: list[asyncio.Task[Attempted]] = []
        self._closed = False

    @property
    def active(self) -> int:
        """Attempts started and not handed back yet."""
        return len(self._running) + len(self._done)

    def start(self, fn: AttemptFn, name: str) -> asyncio.Task[Attempted]:
        if self._closed:
            raise RuntimeError("the attempt set is closed")
        task: asyncio.Task[Attempted] = asyncio.get_running_loop().create_task(fn(), name=name)
        task.add_done_callback(self._on_done)
        self._running.add(task)
        return task

    def _on_done(self, task: asyncio.Task[Attempted]) -> None:
        """Once the scope is closed, a finished attempt nobody took gives its connection back
        (closed unless its body had already ended). While open, ``next`` hands it out."""
        if not self._closed or task.cancelled():
            return
        if task.exception() is None:  # also marks an exception as retrieved
            task.result().discard()

    async def next(self, timeout: float | None) -> Attempted | None:
        """The next finished attempt, or None when ``timeout`` seconds pass first (or nothing
        is running)."""
        if not self._done:
            if not self._running:
                return None
            await self._first_done(timeout)
            done = [t for t in self._running if t.done()]
            if not done:
                return None
            self._running.difference_update(done)
            self._done.extend(done)
        task = self._done.pop(0)
        return task.result()  # raises what escaped the attempt (a bug or a local error)

    async def _first_done(self, timeout: float | None) -> None:
        """Wait until one running attempt is done or ``timeout`` passes (what
        ``asyncio.wait(FIRST_COMPLETED)`` does, without its per-call set and checks: this runs
        for every hedgeable request)."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not waiter.done():
                waiter.set_result(None)

        running = list(self._running)
        for t in running:
            t.add_done_callback(wake)
        handle = loop.call_later(timeout, wake) if timeout is not None else None
        try:
            await waiter
        finally:
            if handle is not None:
                handle.cancel()
            for t in running:
                t.remove_done_callback(wake)

    async def __aenter__(self) -> AttemptSet:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._closed = True
        left = [*self._running, *self._done]
        self._running.clear()
        self._done.clear()
        for task in left:
            if task.done():
                self._on_done(task)  # finished, never handed out: discard it now
            else:
                task.cancel()  # if it finishes anyway, its callback discards it
        pending = [t for t in left if not t.done()]
        if pending:
            # Wait for the cancelled ones to unwind (connections closed, tickets given back)
            # so that nothing of this sequence outlives its scope.
            await asyncio.wait(pending)

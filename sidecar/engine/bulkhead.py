"""The bulkhead of one route: at most ``max_concurrent`` sequences in flight upstream.

Past it, a sequence waits at most ``queue_timeout`` (and never past its deadline) for a slot, then
is refused (503 overloaded). The slot is an ``asyncio.Semaphore`` permit held by a scope
(``async with bulkhead.slot(wait)``): it is given back on every exit, and a waiter woken by a
release but cancelled or timed out in the same loop turn hands the wake-up on (the semaphore does
that; a hand-made waiter queue here once leaked every slot under that race).

A reload with another ``max_concurrent`` starts a new semaphore; sequences holding a permit of
the old one give it back to the old one, so the count stays exact across the swap.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from sidecar.config.model import BulkheadPolicy
from sidecar.core import Overloaded


class Bulkhead:
    __slots__ = ("_sem", "in_flight", "policy")

    def __init__(self, policy: BulkheadPolicy) -> None:
        self.policy = policy
        self.in_flight = 0
        self._sem = asyncio.Semaphore(policy.max_concurrent)

    def update_policy(self, policy: BulkheadPolicy) -> None:
        if policy.max_concurrent != self.policy.max_concurrent:
            self._sem = asyncio.Semaphore(policy.max_concurrent)
        self.policy = policy

    def slot(self, wait: float) -> Slot:
        """Hold one slot for the body of the ``async with``; wait at most ``wait`` seconds
        (raises Overloaded)."""
        return Slot(self, wait)


class Slot:
    """One bulkhead permit as an ``async with`` scope. A class rather than an
    ``@asynccontextmanager`` generator: every proxied request takes one, and the generator's
    machinery cost more than the permit itself."""

    __slots__ = ("_bulkhead", "_sem", "_wait")

    def __init__(self, bulkhead: Bulkhead, wait: float) -> None:
        self._bulkhead = bulkhead
        self._wait = wait
        self._sem: asyncio.Semaphore | None = None  # the semaphore the permit came from

    async def __aenter__(self) -> None:
        bh = self._bulkhead
        sem = bh._sem
        if sem.locked():
            try:
                async with asyncio.timeout(max(self._wait, 0.0)):
                    await sem.acquire()
            except TimeoutError:
                raise Overloaded(
                    f"{bh.policy.max_concurrent} upstream requests already in flight"
                ) from None
        else:
            await sem.acquire()  # free: returns at once, no timer armed
        # No await between the permit and this: a cancellation cannot fall in between.
        self._sem = sem
        bh.in_flight += 1

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        """Give the permit back (to the semaphore it came from, even after a reload swapped
        in another); idempotent."""
        sem, self._sem = self._sem, None
        if sem is not None:
            self._bulkhead.in_flight -= 1
            sem.release()

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
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

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

    @asynccontextmanager
    async def slot(self, wait: float) -> AsyncIterator[None]:
        """Hold one slot for the body of the ``async with``; wait at most ``wait`` seconds
        (raises Overloaded)."""
        sem = self._sem
        if sem.locked():
            try:
                async with asyncio.timeout(max(wait, 0.0)):
                    await sem.acquire()
            except TimeoutError:
                raise Overloaded(
                    f"{self.policy.max_concurrent} upstream requests already in flight"
                ) from None
        else:
            await sem.acquire()  # free: returns at once, no timer armed
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            sem.release()

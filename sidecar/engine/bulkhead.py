"""The bulkhead of one route: at most ``max_concurrent`` sequences in flight upstream.

Past it, a sequence waits at most ``queue_timeout`` (and never past its deadline) for a slot, then
is refused (503 overloaded). The slot is an ``asyncio.Semaphore`` permit held by a scope
(``async with bulkhead.slot(wait)``): it is given back on every exit, and a waiter woken by a
release but cancelled or timed out in the same loop turn hands the wake-up on (the semaphore does
that; a hand-made waiter queue here once leaked every slot under that race). The uncontended
permit is taken and given back on the semaphore's counter directly, as ``acquire`` and
``release`` would (no waiter to wake, nothing to wait for).

A reload with another ``max_concurrent`` resizes the one semaphore, and the new size applies to
the sequences already in flight, as Envoy's limits do: a grow hands the new permits to the queue
at once (first come, first served); a shrink below what is in flight is a debt, paid by the next
permits given back or taken, so nothing new starts until the count is under the new size.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

from sidecar.config.model import BulkheadPolicy
from sidecar.core import Overloaded


class Bulkhead:
    __slots__ = ("_debt", "_sem", "in_flight", "policy")

    def __init__(self, policy: BulkheadPolicy) -> None:
        self.policy = policy
        self.in_flight = 0
        self._sem = asyncio.Semaphore(policy.max_concurrent)
        # Permits the last shrink took away that were not free then: each permit given back
        # or taken while it is above zero pays one off instead of letting a sequence run.
        # Always: free permits + in_flight - debt == max_concurrent.
        self._debt = 0

    def update_policy(self, policy: BulkheadPolicy) -> None:
        change = policy.max_concurrent - self.policy.max_concurrent
        self.policy = policy
        if change < 0:
            self._debt -= change
            return
        paid = min(change, self._debt)
        self._debt -= paid
        for _ in range(change - paid):
            self._sem.release()  # wakes the head of the queue, if any

    def slot(self, wait: float) -> Slot:
        """Hold one slot for the body of the ``async with``; wait at most ``wait`` seconds
        (raises Overloaded)."""
        return Slot(self, wait)

    def _give_back(self) -> None:
        if self._debt:
            self._debt -= 1
            return
        sem = self._sem
        if not sem._waiters:
            # Nobody waits: what ``release`` does, without its Python-level calls (every
            # proxied request gives one back; tests/proxy/test_ownership.py holds the queue).
            sem._value += 1
        else:
            sem.release()  # wakes the head of the queue


class Slot:
    """One bulkhead permit as an ``async with`` scope. A class rather than an
    ``@asynccontextmanager`` generator: every proxied request takes one, and the generator's
    machinery cost more than the permit itself."""

    __slots__ = ("_bulkhead", "_held", "_wait")

    def __init__(self, bulkhead: Bulkhead, wait: float) -> None:
        self._bulkhead = bulkhead
        self._wait = wait
        self._held = False

    async def __aenter__(self) -> None:
        bh = self._bulkhead
        sem = bh._sem
        if sem._value > 0 and not sem._waiters and not bh._debt:
            # Free and nobody queued: what ``acquire`` does then (it would not yield), without
            # its coroutine and its two ``locked`` calls, which cost more than the permit.
            sem._value -= 1
        elif sem.locked() or bh._debt:
            try:
                async with asyncio.timeout(max(self._wait, 0.0)):
                    await sem.acquire()
                    while bh._debt:  # a shrink left a debt: this permit pays it off
                        bh._debt -= 1
                        await sem.acquire()
            except TimeoutError:
                raise Overloaded(
                    f"{bh.policy.max_concurrent} upstream requests already in flight"
                ) from None
        else:
            await sem.acquire()  # free: returns at once, no timer armed
        # No await between the permit and this: a cancellation cannot fall in between.
        self._held = True
        bh.in_flight += 1

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    def release(self) -> None:
        """Give the permit back; idempotent."""
        if self._held:
            self._held = False
            self._bulkhead.in_flight -= 1
            self._bulkhead._give_back()

"""The bulkhead of one route: at most ``max_concurrent`` upstream attempts in flight.

Past it, a request waits at most ``queue_timeout`` for a slot, then is refused (503 overloaded).
"""

from __future__ import annotations

import asyncio
from collections import deque

from sidecar.config.model import BulkheadPolicy
from sidecar.upstream.errors import Overloaded


class Bulkhead:
    def __init__(self, policy: BulkheadPolicy) -> None:
        self.policy = policy
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    def update_policy(self, policy: BulkheadPolicy) -> None:
        self.policy = policy
        self._wake()

    async def acquire(self) -> None:
        if self.in_flight < self.policy.max_concurrent and not self._waiters:
            self.in_flight += 1
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        self._waiters.append(fut)
        try:
            async with asyncio.timeout(self.policy.queue_timeout):
                await fut
        except TimeoutError:
            raise Overloaded(
                f"{self.policy.max_concurrent} upstream requests already in flight"
            ) from None
        finally:
            if fut in self._waiters:
                self._waiters.remove(fut)
        # The slot was handed over by release(): in_flight already counts it.

    def release(self) -> None:
        self.in_flight -= 1
        self._wake()

    def _wake(self) -> None:
        while self._waiters and self.in_flight < self.policy.max_concurrent:
            fut = self._waiters.popleft()
            if not fut.done():
                self.in_flight += 1
                fut.set_result(None)

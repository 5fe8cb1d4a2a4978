"""Process lifecycle shared by the proxy and the admin side: ready, draining, backoff sleeps
that a drain can cut short."""

from __future__ import annotations

import asyncio


class Lifecycle:
    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self._sleepers: set[asyncio.Future[None]] = set()

    def start_drain(self) -> None:
        self.draining = True
        self.ready = False
        for fut in list(self._sleepers):
            if not fut.done():
                fut.set_result(None)

    async def sleep(self, delay: float) -> None:
        """Sleep ``delay`` seconds, or less if a drain starts meanwhile."""
        if self.draining or delay <= 0:
            return
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        handle = loop.call_later(delay, _wake, fut)
        self._sleepers.add(fut)
        try:
            await fut
        finally:
            handle.cancel()
            self._sleepers.discard(fut)


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)

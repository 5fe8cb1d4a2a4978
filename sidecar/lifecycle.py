"""Process lifecycle shared by the proxy and the admin side: ready, draining, backoff sleeps
that a drain can cut short and a kill switch can nudge."""

from __future__ import annotations

import asyncio


class Lifecycle:
    def __init__(self) -> None:
        self.ready = False
        self.draining = False
        self._sleepers: set[asyncio.Future[bool]] = set()

    @property
    def sleeping(self) -> int:
        """How many backoff sleeps are under way now."""
        return len(self._sleepers)

    def start_drain(self) -> None:
        self.draining = True
        self.ready = False
        for fut in list(self._sleepers):
            if not fut.done():
                fut.set_result(False)

    def nudge_sleepers(self) -> None:
        """Wake every backoff sleep early (a kill switch was set): each sleeper asks whether
        it still has a reason to wait, and sleeps the rest of its delay if so."""
        for fut in list(self._sleepers):
            if not fut.done():
                fut.set_result(True)

    async def sleep(self, delay: float) -> bool:
        """Sleep ``delay`` seconds, or less if a drain starts meanwhile. True when the sleep
        was nudged (``nudge_sleepers``) before its time."""
        if self.draining or delay <= 0:
            return False
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bool] = loop.create_future()
        handle = loop.call_later(delay, _wake, fut)
        self._sleepers.add(fut)
        try:
            return await fut
        finally:
            handle.cancel()
            self._sleepers.discard(fut)


def _wake(fut: asyncio.Future[bool]) -> None:
    if not fut.done():
        fut.set_result(False)

"""Hedging as the real ``retry-sidecar run`` process does it (uvloop, as shipped), seen from
outside: what the upstream receives, and when."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.test_contract import start_process


class Items:
    """An upstream holding items: GET answers at once; DELETE deletes, then takes ``slow``
    seconds to answer (404 at once for an item already gone). It counts the copies of a request
    it holds at the same time."""

    def __init__(self, slow: float) -> None:
        self.slow = slow
        self.items = set(range(100))
        self.deletes: list[int] = []
        self.holding = 0
        self.most_held = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method != "DELETE":
            return web.Response(text="item")
        item = int(request.match_info["item"])
        self.deletes.append(item)
        if item not in self.items:
            return web.Response(status=404)
        self.items.discard(item)
        self.holding += 1
        self.most_held = max(self.most_held, self.holding)
        try:
            await asyncio.sleep(self.slow)
        finally:
            self.holding -= 1
        return web.Response(status=204)


async def serve(items: Items) -> web.AppRunner:
    app = web.Application()
    app.router.add_route("*", "/items/{item}", items.handle)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner


async def test_shipped_defaults_never_duplicate_a_slow_delete(tmp_path: Path) -> None:
    """Finding 4: with the shipped defaults, fast GETs bring the adaptive per-try timeout down
    to its 50 ms floor; a DELETE slower than that was hedged, and the duplicate's 404 (the
    original had deleted the item) won. Hedging is opt-in now: each DELETE reaches the upstream
    once and is answered with what the upstream did (204)."""
    items = Items(slow=0.3)
    runner = await serve(items)
    port = runner.addresses[0][1]
    proc, proxy, _admin = await start_process(
        tmp_path, f'routes:\n  - name: items\n    upstream: "http://127.0.0.1:{port}"\n'
    )
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(30):  # more than the 20 samples the estimate needs
                async with s.get(f"http://127.0.0.1:{proxy}/items/{i}") as r:
                    assert r.status == 200
            statuses = []
            for i in range(5):
                async with s.delete(f"http://127.0.0.1:{proxy}/items/{i}") as r:
                    statuses.append((r.status, r.headers["x-retry-attempts"]))
                    assert "x-retry-hedges" not in r.headers
        assert statuses == [(204, "1")] * 5
        assert items.deletes == [0, 1, 2, 3, 4]  # each once: no copy of a write in progress
        assert items.most_held == 1
    finally:
        proc.terminate()
        await runner.cleanup()

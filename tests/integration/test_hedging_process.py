"""Hedging as the real ``retry-sidecar run`` process does it (uvloop, as shipped), seen from
outside: what the upstream receives, and when."""

from __future__ import annotations

import asyncio
import random
import signal
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.proc import start_process
from tests.wait import until

pytestmark = pytest.mark.slow


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


HEDGED_ROUTE = """routes:
  - name: main
    upstream: "http://127.0.0.1:{port}"
    timeout: 1500ms
    retry:
      attempts: 10
      auto_timeout: {{min: 100ms, max: 100ms}}
      backoff: {{strategy: constant, base: 1ms, max: 1ms}}
    throttle: {{enabled: false}}
    hedge: {{enabled: true, ratio: 100, min_per_second: 100}}
{extra}"""
FILE_SWITCH = """killswitches:
  - {scope: "route:main", reason: "test", until: "2099-01-01T00:00:00Z"}
"""


class Hanging:
    """An upstream that answers ``/warm`` after 150 ms (an attempt past the 100 ms per-try
    timeout: hedging armed) and holds every other request; it counts the arrivals."""

    def __init__(self) -> None:
        self.arrivals = 0

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.path == "/warm":
            await asyncio.sleep(0.15)
            return web.Response(text="warm")
        self.arrivals += 1
        await asyncio.sleep(30)
        return web.Response(text="late")


def hedges_sent(metrics: str) -> int:
    for line in metrics.splitlines():
        if line.startswith('retry_sidecar_hedges_total{route="main",result="sent"}'):
            return int(float(line.split()[-1]))
    return 0


async def test_no_hedge_starts_after_a_kill_switch_a_drain_or_a_reload_that_sets_one(
    tmp_path: Path,
) -> None:
    """Finding 9: a kill switch or a drain started while hedged requests were in flight did not
    stop their hedges (copies left 0.3 s and 0.6 s after). At seeded random points of hedged
    sequences (three at a time, 9 hedges each allowed, one every 100 ms) a kill switch is set
    through the admin API, a reload brings one from the policy file, or SIGTERM starts a drain;
    once it has taken effect, the hedges sent so far are read from /metrics. No hedge may start
    after that: the count stays, and every upstream arrival is an original or one of those
    hedges."""
    rnd = random.Random(9)
    for trial, mode in enumerate(["kill", "reload", "drain"] * 2):
        (tmp_path / str(trial)).mkdir()
        await switch_mid_hedge(tmp_path / str(trial), rnd, mode)


async def switch_mid_hedge(tmp_path: Path, rnd: random.Random, mode: str) -> None:
    up = Hanging()
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", up.handle)
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    body = HEDGED_ROUTE.format(port=runner.addresses[0][1], extra="")
    proc, proxy, admin = await start_process(tmp_path, body)
    url = f"http://127.0.0.1:{admin}"
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{proxy}/warm") as r:
                assert r.status == 200

            async def hedged_request(j: int) -> str:
                await asyncio.sleep(rnd.uniform(0, 0.2))
                async with s.get(f"http://127.0.0.1:{proxy}/r/{j}") as r:
                    return r.headers["x-retry-fate"]

            requests = [asyncio.create_task(hedged_request(j)) for j in range(3)]
            seen = rnd.randint(1, 6)
            await until(lambda: up.arrivals >= seen, f"{seen} arrivals")
            await asyncio.sleep(rnd.uniform(0, 0.1))  # anywhere between two hedges
            if mode == "kill":
                switch = {"scope": "route:main", "ttl": "1m", "reason": "test"}
                async with s.put(url + "/killswitch", json=switch) as r:
                    assert r.status == 200
            elif mode == "reload":
                cfg = proc.config_path
                cfg.write_text(cfg.read_text() + FILE_SWITCH)
                async with s.post(url + "/config/reload") as r:
                    assert r.status == 200, await r.text()
            else:
                assert proc.proc is not None
                proc.proc.send_signal(signal.SIGTERM)

                async def draining() -> bool:
                    async with s.get(url + "/readyz") as r:
                        return r.status == 503

                while not await draining():  # the drain starts at once: bounded by that
                    await asyncio.sleep(0.01)
            async with s.get(url + "/metrics") as r:
                sent = hedges_sent(await r.text())
            fates = await asyncio.gather(*requests)
            assert up.arrivals <= 3 + sent, (mode, up.arrivals, sent)
            if mode != "drain":  # a drained sidecar is gone by now
                async with s.get(url + "/metrics") as r:
                    assert hedges_sent(await r.text()) == sent, mode
            assert set(fates) <= {"deadline", "kill-switch", "draining"}, fates
    finally:
        proc.terminate()
        await runner.cleanup()

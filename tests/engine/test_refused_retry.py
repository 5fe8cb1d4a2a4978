"""A retry that the sidecar's own limits refuse relays the last upstream answer.

After an upstream 503, the retry finds the connection pool full: the upstream was not asked
again, so its 503 stands, with fate ``overloaded`` -- as when the budget or the throttle
refuses a retry -- instead of the sidecar's own ``503 pool-exhausted``. The refused retry is
not counted as sent. Run against the real process (uvloop, as shipped) and in-process
(asyncio), on exact conditions: the pool has one connection, and the request that takes it
is queued for it (the pool says so) before the upstream answers the first one.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.conftest import Handler, Upstream, routes_yaml
from tests.proc import SidecarProcess, free_port
from tests.wait import until

POOL = "upstream_pool: {max_connections: 1, wait_timeout: 1s}"
ROUTE = "    timeout: 30s\n    retry: {attempts: 3}\n"


def scripted() -> tuple[Handler, asyncio.Event, asyncio.Event]:
    """/x answers 503 once ``answer`` is set; /slow holds the connection until ``finish``."""
    answer, finish = asyncio.Event(), asyncio.Event()

    async def h(request: web.Request) -> web.StreamResponse:
        if request.path == "/slow":
            await finish.wait()
            return web.Response(text="slow done")
        await answer.wait()
        return web.Response(status=503, text="upstream says down")

    return h, answer, finish


async def refused_retry_relays(
    client: aiohttp.ClientSession,
    url: str,
    up: Upstream,
    answer: asyncio.Event,
    finish: asyncio.Event,
    waiting: Callable[[], Awaitable[int]],
) -> None:
    first = asyncio.create_task(client.get(url + "/x"))
    await until(lambda: len(up.seen) == 1, "the first attempt at the upstream")
    holder = asyncio.create_task(client.get(url + "/slow"))
    for _ in range(1500):  # bounded: the second request queues for the one connection
        if await waiting() == 1:
            break
        await asyncio.sleep(0.01)
    assert await waiting() == 1
    # The 503 arrives; its connection goes to the queued request, which the upstream holds:
    # the retry finds the pool full for its whole wait.
    answer.set()
    r = await asyncio.wait_for(first, 20)
    body = await r.read()
    assert (r.status, body) == (503, b"upstream says down")
    assert r.headers["x-retry-fate"] == "overloaded"
    assert r.headers["x-retry-attempts"] == "2"
    assert "x-retry-proxy-error" not in r.headers  # the upstream's answer, not the sidecar's
    finish.set()
    h = await asyncio.wait_for(holder, 20)
    assert (h.status, await h.read()) == (200, b"slow done")
    assert [s.raw_path for s in up.seen] == ["/x", "/slow"]  # the retry never went out


async def test_a_retry_refused_by_the_full_pool_relays_the_upstream_answer_in_process(
    upstream_factory, sidecar_factory, client
):
    handler, answer, finish = scripted()
    real = await upstream_factory(handler)
    sc = await sidecar_factory(routes_yaml(real.url, ROUTE, POOL))

    async def waiting() -> int:
        return sum(p.waiting for p in sc.sidecar.client.stats().values())

    await refused_retry_relays(client, sc.url, real, answer, finish, waiting)
    assert [r.attempt for r in sc.recorder.retries] == []  # refused: not a retry sent
    st = sc.sidecar.states.get("main")
    assert st.budget.counts(sc.sidecar.clock.monotonic())[1] == 0  # its token went back
    assert st.bulkhead.in_flight == 0


async def test_a_retry_refused_by_the_full_pool_relays_the_upstream_answer_real_process(
    upstream_factory, tmp_path: Path, client
):
    handler, answer, finish = scripted()
    real = await upstream_factory(handler)
    port, admin = free_port(), free_port()
    text = routes_yaml(real.url, ROUTE, POOL, f'admin: {{listen: "127.0.0.1:{admin}"}}')
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text.replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1))
    proc = SidecarProcess(cfg)
    proc.start()
    try:
        await proc.wait_port(port, admin)

        async def waiting() -> int:
            async with client.get(f"http://127.0.0.1:{admin}/stats") as r:
                stats = json.loads(await r.text())
            return sum(p["waiting"] for p in stats["pool"].values())

        await refused_retry_relays(
            client, f"http://127.0.0.1:{port}", real, answer, finish, waiting
        )
        async with client.get(f"http://127.0.0.1:{admin}/metrics") as m:
            text = await m.text()
        assert 'retry_sidecar_retries_total{route="main"} 0' in text
        assert 'retry_sidecar_requests_total{route="main",fate="overloaded"} 1' in text
    finally:
        proc.terminate()

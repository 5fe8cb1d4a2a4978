"""Real apps through the real sidecar process with its shipped defaults: an app must see the
requests it would see direct, plus retries of failures, never a duplicate of a request still in
progress and never a refusal a direct connection would not make."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.difftools import stop
from tests.proc import free_port
from tests.realapp import start_single_worker_app
from tests.threeways import shipped_defaults_sidecar


@pytest.mark.slow
async def test_slow_handlers_of_a_single_worker_app_run_once_each(tmp_path: Path) -> None:
    """A route of fast GETs and slow GETs in front of gunicorn's single sync worker: each
    slow GET must run its handler once. A hedge of a slow GET (the adaptive per-try timeout
    learnt from the fast ones) queues behind the original in the one worker and runs the
    handler again for nothing; the shipped defaults must never send it."""
    app_port = free_port()
    app = start_single_worker_app(app_port)
    proc, port = await shipped_defaults_sidecar(tmp_path, f"http://127.0.0.1:{app_port}")
    try:
        async with aiohttp.ClientSession() as client:
            for _ in range(40):
                async with client.get(f"http://127.0.0.1:{port}/fast?ms=1") as r:
                    assert r.status == 200
            for _ in range(8):
                async with client.get(f"http://127.0.0.1:{port}/slow?ms=300") as r:
                    assert r.status == 200, await r.text()
                    assert await r.read() == b"done"
            # Straight to the app: its one worker takes connections in the order they came,
            # so any duplicate the sidecar left queued is handled before this count.
            async with client.get(f"http://127.0.0.1:{app_port}/count") as r:
                handled = json.loads(await r.read())
        assert handled == {"/fast": 40, "/slow": 8}
    finally:
        proc.terminate()
        stop(app)


@pytest.mark.slow
async def test_long_polls_are_never_refused(tmp_path: Path) -> None:
    """Long-poll clients (each request held 1.5 s by the app) beside one fast client, as a
    chat or notification app has: direct, the app answers every request. Through the sidecar
    with its shipped defaults it must too: a concurrency limit that reads the long-polls'
    latency as overload and refuses them (or the fast client) is worse than no sidecar."""
    seen: Counter[str] = Counter()

    async def poll(request: web.Request) -> web.Response:
        seen["poll"] += 1
        await asyncio.sleep(1.5)
        return web.Response(text="event")

    async def fast(request: web.Request) -> web.Response:
        seen["fast"] += 1
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/poll", poll)
    app.router.add_get("/fast", fast)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    app_port = int(runner.addresses[0][1])
    proc, port = await shipped_defaults_sidecar(tmp_path, f"http://127.0.0.1:{app_port}")
    statuses: Counter[tuple[str, int]] = Counter()
    until = time.monotonic() + 6.0  # each loop ends by itself

    async def client_loop(client: aiohttp.ClientSession, path: str, pause: float) -> None:
        while time.monotonic() < until:
            async with client.get(f"http://127.0.0.1:{port}{path}") as r:
                await r.read()
                statuses[(path, r.status)] += 1
            await asyncio.sleep(pause)

    try:
        conn = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=conn) as client:
            await asyncio.gather(
                *(client_loop(client, "/poll", 0) for _ in range(120)),
                client_loop(client, "/fast", 0.02),
            )
        refused = {k: n for k, n in statuses.items() if k[1] != 200}
        assert refused == {}, f"refused through the sidecar: {refused} of {dict(statuses)}"
        assert seen["poll"] == statuses[("/poll", 200)]
        assert seen["fast"] == statuses[("/fast", 200)]
    finally:
        proc.terminate()
        await runner.cleanup()


async def test_an_upload_of_many_mib_passes_as_direct(tmp_path: Path) -> None:
    """A 20 MiB upload (a git push, a package upload) through the shipped defaults reaches
    the app whole, as direct: no body limit is set by default (it was 1 MiB: 413). Sent with
    Content-Length and chunked; streamed (over retry.max_body_bytes), never held."""
    received: list[bytes] = []

    async def take(request: web.Request) -> web.Response:
        received.append(await request.read())
        return web.Response(text="stored")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_put("/upload", take)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    app_port = int(runner.addresses[0][1])
    proc, port = await shipped_defaults_sidecar(tmp_path, f"http://127.0.0.1:{app_port}")
    body = bytes(range(256)) * (20 * 1024 * 1024 // 256)

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 1024 * 1024):
            yield body[i : i + 1024 * 1024]

    try:
        async with aiohttp.ClientSession() as client:
            async with client.put(f"http://127.0.0.1:{port}/upload", data=body) as r:
                assert (r.status, await r.text()) == (200, "stored")
            async with client.put(f"http://127.0.0.1:{port}/upload", data=chunks()) as r:
                assert (r.status, await r.text()) == (200, "stored")
        assert received == [body, body]
    finally:
        proc.terminate()
        await runner.cleanup()

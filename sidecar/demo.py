"""``retry-sidecar demo``: a flaky upstream and a sidecar in one process, a burst of traffic
sent directly and through the sidecar, and a table of what the sidecar did."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from sidecar.app import Sidecar
from sidecar.config.parse import parse_text
from sidecar.telemetry.events import Recorder

ENDPOINTS = {
    "/flaky": "40% of replies are 503",
    "/reset": "30% of connections are reset",
    "/slow": "30% of replies take 1.5 s",
    "/busy": "30% are 503 with Retry-After: 1",
}
CLIENT_TIMEOUT = 1.0
CONCURRENCY = 20


def flaky_app(rng: random.Random) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        p = rng.random()
        path = request.path
        if path == "/flaky" and p < 0.4:
            return web.Response(status=503, text="flaky\n")
        if path == "/reset" and p < 0.3:
            if request.transport is not None:
                request.transport.abort()
            return web.Response(status=500)
        if path == "/slow" and p < 0.3:
            await asyncio.sleep(1.5)
        if path == "/busy" and p < 0.3:
            return web.Response(status=503, headers={"Retry-After": "1"}, text="busy\n")
        return web.Response(text="ok\n")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    return app


def demo_config(upstream_port: int) -> str:
    return f"""
version: 1
name: demo-sidecar
listen: "127.0.0.1:0"
defaults:
  timeout: 3s
  retry:
    attempts: 4
    per_try_timeout: 250ms
    backoff: {{strategy: full_jitter, base: 20ms, max: 200ms}}
    retry_after: {{honor: true, max: 2s}}
routes:
  - name: busy
    match: {{path_prefix: /busy}}
    upstream: "http://127.0.0.1:{upstream_port}"
  - name: demo
    match: {{path_prefix: /}}
    upstream: "http://127.0.0.1:{upstream_port}"
"""


@dataclass
class Tally:
    ok: int = 0
    total: int = 0
    attempts: int = 0
    fates: Counter[str] = field(default_factory=Counter)


async def burst(base: str, path: str, n: int, via_sidecar: bool) -> Tally:
    tally = Tally()
    sem = asyncio.Semaphore(CONCURRENCY)
    timeout = aiohttp.ClientTimeout(total=None if via_sidecar else CLIENT_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=CONCURRENCY, force_close=not via_sidecar)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one() -> None:
            async with sem:
                tally.total += 1
                try:
                    async with session.get(base + path) as resp:
                        await resp.read()
                        if resp.status == 200:
                            tally.ok += 1
                        tally.attempts += int(resp.headers.get("x-retry-attempts", "1"))
                        tally.fates[resp.headers.get("x-retry-fate", "-")] += 1
                except (aiohttp.ClientError, TimeoutError):
                    tally.attempts += 1
                    tally.fates["client-error"] += 1

        await asyncio.gather(*(one() for _ in range(n)))
    return tally


async def run_demo(requests: int = 100, seed: int | None = None) -> int:
    started = time.monotonic()
    rng = random.Random(seed)
    runner = web.AppRunner(flaky_app(rng), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = int(runner.addresses[0][1])
    sidecar = Sidecar(parse_text(demo_config(port), "<demo>"))
    recorder = Recorder()
    sidecar.add_sink(recorder)
    await sidecar.start()
    print(f"flaky upstream on 127.0.0.1:{port}, sidecar on 127.0.0.1:{sidecar.proxy_port}")
    print(f"sending {requests} GETs per endpoint, {CONCURRENCY} at a time, direct then via sidecar")
    print(f"(a direct client gives up after {CLIENT_TIMEOUT:g}s; the sidecar's deadline is 3s)\n")
    rows = []
    try:
        for path, what in ENDPOINTS.items():
            direct = await burst(f"http://127.0.0.1:{port}", path, requests, False)
            via = await burst(f"http://127.0.0.1:{sidecar.proxy_port}", path, requests, True)
            rows.append((path, what, direct, via))
    finally:
        await sidecar.stop()
        await runner.cleanup()

    header = f"{'endpoint':<8} {'failure mode':<34} {'direct ok':>9} {'sidecar ok':>10} "
    header += f"{'attempts/req':>12}  fates"
    print(header)
    print("-" * len(header))
    for path, what, d, v in rows:
        fates = ", ".join(f"{k} {c}" for k, c in v.fates.most_common())
        per_req = v.attempts / max(1, v.total)
        print(f"{path:<8} {what:<34} {_pct(d):>9} {_pct(v):>10} {per_req:>12.2f}  {fates}")
    honoured = sum(1 for r in recorder.retries if r.from_retry_after)
    print(
        f"\nthe sidecar made {len(recorder.attempts)} upstream attempts for "
        f"{len(recorder.sequences)} requests: {len(recorder.retries)} retries, "
        f"{honoured} of them waiting out a Retry-After."
    )
    print(
        "note: the direct client is aiohttp's, which itself silently resends an idempotent\n"
        "request once when a kept-alive connection breaks; the sidecar counts every resend."
    )
    print(f"done in {time.monotonic() - started:.1f}s")
    return 0


def _pct(t: Tally) -> str:
    return f"{100.0 * t.ok / max(1, t.total):.1f}%"

"""Soak: a bounded run at a steady rate with 20% of upstream attempts failing in mixed ways, a
config reload and a kill-switch flip in the middle. Prints RSS, open file descriptors, pool
connections and asyncio task count of the real sidecar process at the start and every interval,
plus the client-visible success rate. The goal is flat lines.

    python3 -m bench.soak [--minutes 10] [--rate 200] [--interval 60]

Loopback only; it stops the sidecar it started (by PID) and itself when the time is up.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.proc import SidecarProcess, free_port


def config(up: int, port: int, admin: int, attempts: int) -> str:
    return f"""
version: 1
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
defaults:
  timeout: 3s
  retry: {{attempts: {attempts}, per_try_timeout: 200ms, backoff: {{base: 5ms, max: 50ms}}}}
  breaker: {{min_sequences: 1000000}}
  budget: {{ratio: 0.5, min_per_second: 50}}
routes:
  - name: soak
    upstream: "http://127.0.0.1:{up}"
"""


def flaky(rng: random.Random) -> web.Application:
    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        p = rng.random()
        if p < 0.08:
            return web.Response(status=503)
        if p < 0.14:
            if request.transport is not None:
                request.transport.abort()  # reset
            return web.Response(status=500)
        if p < 0.20:
            await asyncio.sleep(0.5)  # past the per-try timeout
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_route("*", "/{t:.*}", handle)
    return app


async def main(args: argparse.Namespace) -> list[dict[str, object]]:
    runner = web.AppRunner(flaky(random.Random(1)), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    up = int(runner.addresses[0][1])
    port, admin = free_port(), free_port()
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as d:
        cfg = Path(d) / "sidecar.yaml"
        cfg.write_text(config(up, port, admin, 3))
        proc = SidecarProcess(cfg)
        proc.start()
        try:
            await proc.wait_port(port)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
                rows = await drive(s, args, port, admin, cfg, up)
        finally:
            proc.terminate()
    await runner.cleanup()
    return rows


async def drive(
    s: aiohttp.ClientSession, args: argparse.Namespace, port: int, admin: int, cfg: Path, up: int
) -> list[dict[str, object]]:
    total = args.minutes * 60
    start = time.monotonic()
    ok = sent = 0
    window_ok = window_sent = 0
    rows: list[dict[str, object]] = []
    events_done: set[str] = set()
    inflight: set[asyncio.Task[None]] = set()

    async def one() -> None:
        nonlocal ok, window_ok
        try:
            async with s.get(f"http://127.0.0.1:{port}/soak") as r:
                await r.read()
                if r.status == 200:
                    ok += 1
                    window_ok += 1
        except (aiohttp.ClientError, TimeoutError):
            pass

    async def sample(label: str) -> None:
        nonlocal window_ok, window_sent
        async with s.get(f"http://127.0.0.1:{admin}/stats") as r:
            st = await r.json()
        pool = sum(p["total"] for p in st["pool"].values())
        row = {
            "t": round(time.monotonic() - start),
            "event": label,
            "rss_mb": round(st["rss_bytes"] / 1e6, 1),
            "fds": st["open_fds"],
            "pool": pool,
            "tasks": st["asyncio_tasks"],
            "success_pct": round(100.0 * window_ok / window_sent, 2) if window_sent else None,
        }
        rows.append(row)
        print(
            f"t={row['t']:>5}s  rss={row['rss_mb']:>6} MB  fds={row['fds']:>4}  pool={pool:>4}  "
            f"tasks={row['tasks']:>4}  success={row['success_pct']}%  {label}",
            flush=True,
        )
        window_ok = window_sent = 0

    await sample("start")
    next_sample = start + args.interval
    i = 0
    while (now := time.monotonic()) - start < total:
        if "reload" not in events_done and now - start >= total * 0.4:
            cfg.write_text(config(up, port, admin, 4))
            async with s.post(f"http://127.0.0.1:{admin}/config/reload") as r:
                print(f"reload: {r.status} {await r.text()}", flush=True)
            events_done.add("reload")
        if "kill" not in events_done and now - start >= total * 0.5:
            async with s.put(
                f"http://127.0.0.1:{admin}/killswitch",
                json={"scope": "global", "ttl": "10m", "reason": "soak flip"},
            ) as r:
                print(f"kill switch on: {r.status}", flush=True)
            events_done.add("kill")
        if "unkill" not in events_done and now - start >= total * 0.6:
            async with s.delete(f"http://127.0.0.1:{admin}/killswitch?scope=global") as r:
                print(f"kill switch off: {r.status}", flush=True)
            events_done.add("unkill")
        if now >= next_sample:
            await sample("")
            next_sample += args.interval
        t = asyncio.create_task(one())
        inflight.add(t)
        t.add_done_callback(inflight.discard)
        i += 1
        sent += 1
        window_sent += 1
        await asyncio.sleep(max(0.0, start + i / args.rate - time.monotonic()))
    await asyncio.gather(*inflight)
    await asyncio.sleep(1.0)
    await sample("end")
    print(f"\nclient-visible success over the run: {100.0 * ok / max(1, sent):.2f}% of {sent}")
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=200.0)
    ap.add_argument("--interval", type=float, default=60.0)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = asyncio.run(main(a))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))

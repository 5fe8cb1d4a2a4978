"""Idempotency benchmark: the p99 latency a guarded write adds over an unguarded one at a fixed
rate (500 req/s by default, open loop: requests are sent on schedule whatever the answers), and
how fast a replay is answered against the app itself.

    python3 -m bench.idempotency [--rate 500] [--seconds 10] [--app-ms 5] [--block 1]

The unguarded and the guarded route are measured in alternating blocks of ``--block`` seconds
(``--seconds`` in all for each), so a noisy moment of a shared machine falls on both.

The real sidecar process and a real aiohttp app on loopback; every request of the guarded run
carries a fresh key (each one a first write: claim, forward, keep). Bounded: it stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.proc import SidecarProcess, free_port


def config(app_port: int, port: int, admin: int, db: Path) -> str:
    return f"""
version: 1
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
idempotency: {{path: "{db}"}}
defaults:
  breaker: {{min_sequences: 1000000}}
routes:
  - name: guarded
    match: {{path_prefix: /guarded}}
    upstream: "http://127.0.0.1:{app_port}"
    idempotency: {{enabled: true}}
  - name: plain
    upstream: "http://127.0.0.1:{app_port}"
"""


async def start_app(app_ms: float) -> tuple[web.AppRunner, int]:
    async def write(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(app_ms / 1000)
        return web.json_response({"ok": True}, status=201)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", write)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


async def paced(
    s: aiohttp.ClientSession, url: str, rate: float, seconds: float, key_prefix: str | None
) -> list[float]:
    """Latencies (s) of ``rate * seconds`` POSTs sent on schedule."""
    lat: list[float] = []
    body = b'{"order": 1, "pad": "' + b"x" * 200 + b'"}'

    async def one(i: int) -> None:
        headers = {"Idempotency-Key": f"{key_prefix}-{i}"} if key_prefix else {}
        t0 = time.perf_counter()
        async with s.post(url, data=body, headers=headers) as r:
            await r.read()
            assert r.status == 201, r.status
        lat.append(time.perf_counter() - t0)

    tasks = []
    start = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = start + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(i)))
    await asyncio.gather(*tasks)
    return lat


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


async def replays(url: str, n: int) -> list[float]:
    lat: list[float] = []
    async with aiohttp.ClientSession() as s:
        for _ in range(n):
            t0 = time.perf_counter()
            async with s.post(url, data=b'{"order": 1}', headers={"Idempotency-Key": "r"}) as r:
                await r.read()
            lat.append(time.perf_counter() - t0)
    return lat[1:]  # the first is the write itself


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--app-ms", type=float, default=5.0)
    ap.add_argument("--block", type=float, default=1.0, help="seconds per alternating block")
    args = ap.parse_args()
    runner, app_port = await start_app(args.app_ms)
    port, admin = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = Path(tmp) / "sidecar.yaml"
        cfg.write_text(config(app_port, port, admin, Path(tmp) / "keys.sqlite3"))
        proc = SidecarProcess(cfg)
        proc.start()
        try:
            await proc.wait_port(port, admin)
            base = f"http://127.0.0.1:{port}"
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                await paced(session, f"{base}/warm", args.rate, 1.0, None)  # warm up pools
                out: dict[str, object] = {"rate": args.rate, "seconds": args.seconds}
                # Alternating blocks of ``--block`` seconds, so both runs see the same machine (it
                # is shared: a 10 s run of one then the other compares two different moments).
                lats: dict[str, list[float]] = {"unguarded": [], "guarded": []}
                blocks = max(1, round(args.seconds / args.block))
                for b in range(blocks):
                    for name, path, key in (
                        ("unguarded", "/plain", None),
                        ("guarded", "/guarded", f"k{b}"),
                    ):
                        lats[name] += await paced(session, base + path, args.rate, args.block, key)
            for name, lat in lats.items():
                out[name] = {"n": len(lat), "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99)}
            g, u = out["guarded"], out["unguarded"]
            assert isinstance(g, dict) and isinstance(u, dict)
            out["guarded_adds_p99_ms"] = g["p99_ms"] - u["p99_ms"]
            rep = await replays(base + "/guarded/replay", 200)
            out["replay_p50_ms"] = pct(rep, 0.5)
            out["replay_p99_ms"] = pct(rep, 0.99)
            out["app_ms"] = args.app_ms
            print(json.dumps(out, indent=2))
        finally:
            proc.terminate()
            await runner.cleanup()


if __name__ == "__main__":
    asyncio.run(main())

"""Idempotency benchmark: the latency a guarded write adds, with each store, over an unguarded
one and over no proxy at a fixed rate (500 req/s by default, open loop: requests are sent on
schedule whatever the answers), and how fast a replay is answered against the app itself.

    python3 -m bench.idempotency [--rate 500] [--seconds 10] [--app-ms 5] [--block 1]
                                 [--appendfsync always]

One run, one real aiohttp app on loopback, two real sidecar processes with shipped defaults
except where the keys live: one with the SQLite store (``idempotency: {backend: sqlite}``), one
with the fleet's Redis store (``idempotency: {backend: redis}``, a real ``redis-server`` with
``appendonly yes`` and ``appendfsync always``, as the README asks of it: tests/redisserver.py;
``--appendfsync everysec`` or ``no`` sets it otherwise, to tell Redis's fsync from the rest).
Five arms: the app directly (no proxy), and per store an unguarded and a guarded route. They are
measured in alternating blocks of ``--block`` seconds (``--seconds`` in all for each; the order
rotates from block to block), so a noisy moment of a shared machine falls on all of them. Every
request of a guarded arm carries a fresh key (each one a first write: claim, forward, keep).
Bounded: it stops by itself, and stops the processes it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis
from aiohttp import web

from tests import redisserver
from tests.proc import SidecarProcess, free_port

STORES = ("sqlite", "redis")
DIRECT = "no proxy"


def storage(store: str, directory: Path, redis_url: str) -> str:
    """The top-level sections that keep the keys in ``store``: the lines that differ between the
    two sidecars (everything else is the same and shipped defaults)."""
    if store == "sqlite":
        return f'idempotency: {{backend: sqlite, path: "{directory / "keys.sqlite3"}"}}\n'
    return f'idempotency: {{backend: redis}}\nfleet: {{redis: {{url: "{redis_url}"}}}}\n'


def config(app_port: int, port: int, admin: int, store_sections: str) -> str:
    return f"""
version: 1
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
{store_sections}
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


Sample = tuple[float, int]  # one request's latency (s) and the status it got


async def paced(
    s: aiohttp.ClientSession, url: str, rate: float, seconds: float, key_prefix: str | None
) -> list[Sample]:
    """Latencies and statuses of ``rate * seconds`` POSTs sent on schedule. A status other than
    the app's 201 (a 503 of ``on_store_error: refuse`` when the store did not answer in time)
    is counted, not fatal: the run goes on and says how many."""
    lat: list[Sample] = []
    body = b'{"order": 1, "pad": "' + b"x" * 200 + b'"}'

    async def one(i: int) -> None:
        headers = {"Idempotency-Key": f"{key_prefix}-{i}"} if key_prefix else {}
        t0 = time.perf_counter()
        async with s.post(url, data=body, headers=headers) as r:
            await r.read()
        lat.append((time.perf_counter() - t0, r.status))

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


@dataclass(frozen=True)
class Arm:
    """One series of requests: where they go, and the keys' prefix when they are guarded."""

    name: str
    url: str
    keys: str | None


def arms(app_port: int, sidecars: dict[str, int]) -> list[Arm]:
    out = [Arm(DIRECT, f"http://127.0.0.1:{app_port}/direct", None)]
    for store, port in sidecars.items():
        base = f"http://127.0.0.1:{port}"
        out.append(Arm(f"{store} unguarded", f"{base}/plain", None))
        out.append(Arm(f"{store} guarded", f"{base}/guarded", store))
    return out


def added(slower: dict[str, float], faster: dict[str, float]) -> dict[str, float]:
    """What ``slower`` adds over ``faster`` at p50 and p99, in ms and as a ratio."""
    out: dict[str, float] = {}
    for p in ("p50", "p99"):
        out[f"{p}_ms"] = slower[f"{p}_ms"] - faster[f"{p}_ms"]
        out[f"{p}_ratio"] = slower[f"{p}_ms"] / faster[f"{p}_ms"]
    return out


def summary(lats: dict[str, list[Sample]], replay: dict[str, list[float]]) -> dict[str, object]:
    series = {
        name: {
            "n": len(lat),
            "not_201": sum(1 for _, status in lat if status != 201),
            "p50_ms": pct([t for t, _ in lat], 0.5),
            "p99_ms": pct([t for t, _ in lat], 0.99),
        }
        for name, lat in lats.items()
    }
    stores: dict[str, object] = {}
    for store in STORES:
        guarded, unguarded = series[f"{store} guarded"], series[f"{store} unguarded"]
        rep = replay[store]
        stores[store] = {
            "guarded_vs_unguarded": added(guarded, unguarded),
            "guarded_vs_no_proxy": added(guarded, series[DIRECT]),
            "unguarded_vs_no_proxy": added(unguarded, series[DIRECT]),
            "replay_p50_ms": pct(rep, 0.5),
            "replay_p99_ms": pct(rep, 0.99),
        }
    return {"series": series, "stores": stores}


def table(out: dict[str, object]) -> str:
    """The figures as the README's Markdown table: one row per store."""
    series, stores = out["series"], out["stores"]
    assert isinstance(series, dict) and isinstance(stores, dict)
    d = series[DIRECT]
    rows = [
        f"no proxy: p50 / p99 {d['p50_ms']:.2f} / {d['p99_ms']:.2f} ms",
        "",
        "| store | unguarded p50 / p99 | guarded p50 / p99 | guarded adds at p50 / p99 "
        "| guarded vs no proxy, p50 / p99 | replay p50 / p99 |",
        "|---|---|---|---|---|---|",
    ]
    for store in STORES:
        u, g, s = series[f"{store} unguarded"], series[f"{store} guarded"], stores[store]
        vu, vd = s["guarded_vs_unguarded"], s["guarded_vs_no_proxy"]
        rows.append(
            f"| {store} | {u['p50_ms']:.2f} / {u['p99_ms']:.2f} ms "
            f"| {g['p50_ms']:.2f} / {g['p99_ms']:.2f} ms "
            f"| {vu['p50_ms']:+.2f} / **{vu['p99_ms']:+.2f} ms** "
            f"({vu['p50_ratio']:.2f}x / {vu['p99_ratio']:.2f}x) "
            f"| {vd['p50_ms']:+.2f} / {vd['p99_ms']:+.2f} ms "
            f"({vd['p50_ratio']:.2f}x / {vd['p99_ratio']:.2f}x) "
            f"| {s['replay_p50_ms']:.2f} / {s['replay_p99_ms']:.2f} ms |"
        )
    refused = {name: int(s["not_201"]) for name, s in series.items() if s["not_201"]}
    rows.append(f"\nanswers other than the app's 201: {refused or 'none'}")
    return "\n".join(rows)


@contextmanager
def redis_server(directory: Path, appendfsync: str = "always") -> Iterator[redisserver.RedisServer]:
    """A real redis-server (AOF, fsync on every write unless ``appendfsync`` says otherwise),
    stopped by PID however the run ends."""
    if not redisserver.available():
        raise SystemExit("redis-server is not installed (.ci/run installs Debian's redis-server)")
    server = redisserver.RedisServer(directory)
    try:
        server.start()
        with redis.Redis(port=server.port) as client:
            client.config_set("appendfsync", appendfsync)
        yield server
    finally:
        server.stop()


async def measure(args: argparse.Namespace, app_port: int, directory: Path) -> dict[str, object]:
    with redis_server(directory / "redis-server", args.appendfsync) as server:
        procs: list[SidecarProcess] = []
        try:
            sidecars: dict[str, int] = {}
            for store in STORES:
                port, admin = free_port(), free_port()
                (directory / store).mkdir()
                cfg = directory / store / "sidecar.yaml"
                sections = storage(store, directory / store, server.url)
                cfg.write_text(config(app_port, port, admin, sections))
                proc = SidecarProcess(cfg)
                procs.append(proc)
                proc.start()
                await proc.wait_port(port, admin)
                sidecars[store] = port
            every = arms(app_port, sidecars)
            lats: dict[str, list[Sample]] = {a.name: [] for a in every}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                for arm in every:  # warm up the pools (and each store's first key)
                    warm = f"warm-{arm.keys}" if arm.keys else None
                    await paced(session, arm.url, args.rate, 1.0, warm)
                blocks = max(1, round(args.seconds / args.block))
                for b in range(blocks):
                    turn = b % len(every)  # rotated, so no arm always follows the same one
                    for arm in every[turn:] + every[:turn]:
                        keys = f"{arm.keys}-k{b}" if arm.keys else None
                        lats[arm.name] += await paced(session, arm.url, args.rate, args.block, keys)
            replay = {
                store: await replays(f"http://127.0.0.1:{port}/guarded/replay", 200)
                for store, port in sidecars.items()
            }
        finally:
            for proc in procs:
                if proc.proc is not None:
                    proc.terminate()
    return summary(lats, replay)


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--app-ms", type=float, default=5.0)
    ap.add_argument("--block", type=float, default=1.0, help="seconds per alternating block")
    ap.add_argument("--appendfsync", choices=("always", "everysec", "no"), default="always")
    args = ap.parse_args()
    runner, app_port = await start_app(args.app_ms)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = await measure(args, app_port, Path(tmp))
    finally:
        await runner.cleanup()
    out.update(
        rate=args.rate,
        seconds=args.seconds,
        app_ms=args.app_ms,
        block=args.block,
        appendfsync=args.appendfsync,
    )
    print(json.dumps(out, indent=2))
    print(table(out))


if __name__ == "__main__":
    asyncio.run(main())

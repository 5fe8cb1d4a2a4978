"""Idempotency benchmark: the latency a guarded write adds, with each store, over an unguarded
one and over no proxy at a fixed rate (500 req/s by default, open loop: requests are sent on
schedule whatever the answers), and how fast a replay is answered against the app itself.

    python3 -m bench.idempotency [--rate 500] [--seconds 10] [--app-ms 5] [--block 1]
                                 [--appendfsync always] [--before CHECKOUT]

One run, one real aiohttp app on loopback, two real sidecar processes with shipped defaults
except where the keys live: one with the SQLite store (``idempotency: {backend: sqlite}``), one
with the fleet's Redis store (``idempotency: {backend: redis}``, a real ``redis-server`` with
``appendonly yes`` and ``appendfsync always``, as docs/fleet.md asks of it: tests/redisserver.py;
``--appendfsync everysec`` or ``no`` sets it otherwise, to tell Redis's fsync from the rest).
Five arms: the app directly (no proxy), and per store an unguarded and a guarded route. They are
measured in alternating blocks of ``--block`` seconds (``--seconds`` in all for each; the order
rotates from block to block), so a noisy moment of a shared machine falls on all of them. Every
request of a guarded arm carries a fresh key (each one a first write: claim, forward, keep).
Bounded: it stops by itself, and stops the processes it started.

CPU: each sidecar's CPU time (all its threads, ``/proc/<pid>/task/*/schedstat``, nanoseconds) is
read before and after every block, so each block gives the CPU per request of one arm on one
process; the ratio guarded / unguarded is taken per round (the two blocks of one rotation, on one
process) and given as its median and spread over the rounds. ``--before CHECKOUT`` starts a second
pair of sidecars importing ``sidecar`` from another checkout (``/work/main``, say) beside this
one's, measured in the same rotation: figures before and after a change, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
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
from tests.proc import ROOT, SidecarProcess, free_port

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
    pid: int | None = None  # the sidecar that serves it, whose CPU the arm's blocks measure


def arms(app_port: int, sidecars: dict[str, tuple[int, int]]) -> list[Arm]:
    """``sidecars``: per name (a store, or "before <store>"), its port and PID."""
    out = [Arm(DIRECT, f"http://127.0.0.1:{app_port}/direct", None)]
    for name, (port, pid) in sidecars.items():
        base = f"http://127.0.0.1:{port}"
        keys = name.replace(" ", "-")
        out.append(Arm(f"{name} unguarded", f"{base}/plain", None, pid))
        out.append(Arm(f"{name} guarded", f"{base}/guarded", keys, pid))
    return out


def cpu_ns(pid: int) -> int:
    """The CPU time of every thread of ``pid`` so far (ns, from the scheduler's accounting)."""
    total = 0
    tasks = Path(f"/proc/{pid}/task")
    for tid in os.listdir(tasks):
        try:
            total += int((tasks / tid / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            continue  # a thread that ended between the listing and the read
    return total


def cpu_summary(per_block: dict[str, list[float]], names: list[str]) -> dict[str, object]:
    """Per sidecar: CPU per request (µs) of each arm, median and range over the blocks, and the
    ratio guarded / unguarded per round (same process, consecutive blocks): median and range."""
    out: dict[str, object] = {}
    for name in names:
        g, u = per_block[f"{name} guarded"], per_block[f"{name} unguarded"]
        ratios = [a / b for a, b in zip(g, u, strict=True) if b > 0]
        out[name] = {
            "guarded_us": _spread(g),
            "unguarded_us": _spread(u),
            "ratio": _spread(ratios),
        }
    return out


def _spread(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {
        "median": statistics.median(s),
        "p10": s[int(0.1 * (len(s) - 1))],
        "p90": s[int(0.9 * (len(s) - 1))],
        "min": s[0],
        "max": s[-1],
    }


def cpu_table(cpu: dict[str, object]) -> str:
    rows = [
        "| sidecar | unguarded CPU/req (median, p10-p90) | guarded CPU/req "
        "| guarded / unguarded (median, p10-p90, min-max) |",
        "|---|---|---|---|",
    ]
    for name, c in cpu.items():
        assert isinstance(c, dict)
        u, g, r = c["unguarded_us"], c["guarded_us"], c["ratio"]
        rows.append(
            f"| {name} | {u['median']:.0f} µs ({u['p10']:.0f}-{u['p90']:.0f}) "
            f"| {g['median']:.0f} µs ({g['p10']:.0f}-{g['p90']:.0f}) "
            f"| **{r['median']:.2f}x** ({r['p10']:.2f}-{r['p90']:.2f}, "
            f"{r['min']:.2f}-{r['max']:.2f}) |"
        )
    return "\n".join(rows)


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
    """The figures as the Markdown table of docs/idempotency.md: one row per store."""
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
    checkouts = {"": str(ROOT)}
    if args.before:
        checkouts["before "] = str(Path(args.before).resolve())
    with redis_server(directory / "redis-server", args.appendfsync) as server:
        procs: list[SidecarProcess] = []
        try:
            sidecars: dict[str, tuple[int, int]] = {}
            for label, checkout in checkouts.items():
                for store in STORES:
                    name = f"{label}{store}"
                    port, admin = free_port(), free_port()
                    where = directory / name.replace(" ", "-")
                    where.mkdir()
                    cfg = where / "sidecar.yaml"
                    sections = storage(store, where, server.url)  # keys differ by arm name
                    cfg.write_text(config(app_port, port, admin, sections))
                    proc = SidecarProcess(cfg, env={"PYTHONPATH": checkout})
                    procs.append(proc)
                    proc.start()
                    await proc.wait_port(port, admin)
                    assert proc.proc is not None
                    sidecars[name] = (port, proc.proc.pid)
            every = arms(app_port, sidecars)
            lats: dict[str, list[Sample]] = {a.name: [] for a in every}
            cpu: dict[str, list[float]] = {a.name: [] for a in every if a.pid is not None}
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256)) as session:
                for arm in every:  # warm up the pools (and each store's first key)
                    warm = f"warm-{arm.keys}" if arm.keys else None
                    await paced(session, arm.url, args.rate, 1.0, warm)
                blocks = max(1, round(args.seconds / args.block))
                for b in range(blocks):
                    turn = b % len(every)  # rotated, so no arm always follows the same one
                    for arm in every[turn:] + every[:turn]:
                        keys = f"{arm.keys}-k{b}" if arm.keys else None
                        before = cpu_ns(arm.pid) if arm.pid is not None else 0
                        got = await paced(session, arm.url, args.rate, args.block, keys)
                        if arm.pid is not None:
                            cpu[arm.name].append((cpu_ns(arm.pid) - before) / 1000 / len(got))
                        lats[arm.name] += got
            replay = {
                name: await replays(f"http://127.0.0.1:{port}/guarded/replay", 200)
                for name, (port, _) in sidecars.items()
            }
        finally:
            for proc in procs:
                if proc.proc is not None:
                    proc.terminate()
    out = summary(lats, replay)
    out["cpu"] = cpu_summary(cpu, list(sidecars))
    return out


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=500.0)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--app-ms", type=float, default=5.0)
    ap.add_argument("--block", type=float, default=1.0, help="seconds per alternating block")
    ap.add_argument("--appendfsync", choices=("always", "everysec", "no"), default="always")
    ap.add_argument(
        "--before", default=None, help="another checkout, run beside this one (same run)"
    )
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
    cpu = out["cpu"]
    assert isinstance(cpu, dict)
    print()
    print(cpu_table(cpu))


if __name__ == "__main__":
    asyncio.run(main())

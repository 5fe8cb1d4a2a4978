"""DLQ benchmark, the SQLite file and the fleet's Redis side by side: durable records per second
during a full outage of a write route, the p99 latency the DLQ write adds, and crash rounds
(SIGKILL mid-stream, count lost) per store, plus rounds where redis-server itself is SIGKILLed
and restarted under the writes.

    python3 -m bench.dlq [--seconds 5] [--clients 32] [--rounds 30] [--redis-rounds 5] [--json F]

Everything runs on loopback against real processes (two sidecars, one per store, and a real
redis-server with ``appendonly yes``, ``appendfsync always``: tests/redisserver.py), stops by
itself and stops what it started by PID. A durable record is a 202 (``respond: accepted``): the
sidecar answers it only after the store confirmed the record (SQLite commit, Redis script).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from bench.dlq_crash import SQLITE, RoundResult, Store, failing_upstream, redis_store, run_rounds
from bench.idempotency import redis_server
from tests.proc import SidecarProcess, free_port

STORES = ("sqlite", "redis")
ROUTES = (("without-dlq", "/plain/w", 503), ("with-dlq", "/dlq/w", 202))  # name, path, answer
BOUNDS = "max_records: 10000000, max_bytes: 10GiB"  # raised out of the way


def sqlite_dlq(directory: Path) -> str:
    """The ``dlq:`` section that keeps the records in a SQLite file in ``directory``."""
    db = directory / "dlq.sqlite3"
    return f'dlq: {{path: "{db}", {BOUNDS}}}'


def redis_dlq(url: str) -> str:
    """The ``fleet:`` and ``dlq:`` sections that keep the records in the Redis at ``url``."""
    return f'fleet: {{redis: {{url: "{url}"}}}}\ndlq: {{backend: redis, {BOUNDS}}}'


def config(up_port: int, port: int, admin_port: int, dlq_section: str) -> str:
    return f"""
version: 1
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin_port}"}}
{dlq_section}
defaults:
  breaker: {{min_sequences: 1000000}}
  budget: {{ratio: 1000}}
  retry: {{attempts: 1}}
routes:
  - name: with-dlq
    match: {{path_prefix: /dlq}}
    upstream: "http://127.0.0.1:{up_port}"
    dlq: {{enabled: true, respond: accepted}}
  - name: without-dlq
    match: {{path_prefix: /plain}}
    upstream: "http://127.0.0.1:{up_port}"
"""


@dataclass
class Run:
    store: str
    route: str
    per_second: float  # answers of the route's kind (202 with the DLQ, 503 without) per second
    other: int  # any other answer (with the DLQ: a write not stored, x-retry-dlq unavailable)
    p50_ms: float
    p99_ms: float


async def load(
    url: str, seconds: float, clients: int, expected: int
) -> tuple[int, int, list[float]]:
    """``clients`` closed-loop writers for ``seconds``: (answers ``expected``, others, latencies)."""
    ok = other = 0
    lat: list[float] = []
    end = time.monotonic() + seconds
    body = b'{"order": 1, "pad": "' + b"x" * 200 + b'"}'

    async def worker() -> None:
        nonlocal ok, other
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            while time.monotonic() < end:
                t = time.perf_counter()
                async with s.post(url, data=body) as r:
                    await r.read()
                    if r.status == expected:
                        ok += 1
                    else:
                        other += 1
                lat.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(clients)))
    return ok, other, lat


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))] if s else 0.0


async def throughput(args: argparse.Namespace, up_port: int, d: Path, redis_url: str) -> list[Run]:
    """One sidecar per store, both up; runs rotated A B A B over stores and routes."""
    procs: dict[str, tuple[SidecarProcess, int]] = {}
    try:
        for store in STORES:
            port, admin_port = free_port(), free_port()
            (d / store).mkdir()
            cfg = d / store / "sidecar.yaml"
            section = sqlite_dlq(d / store) if store == "sqlite" else redis_dlq(redis_url)
            cfg.write_text(config(up_port, port, admin_port, section))
            proc = SidecarProcess(cfg)
            procs[store] = (proc, port)
            proc.start()
            await proc.wait_port(port, admin_port)
        runs = []
        for _ in range(2):
            for store in STORES:
                for route, path, expected in ROUTES:
                    url = f"http://127.0.0.1:{procs[store][1]}{path}"
                    n, other, lat = await load(url, args.seconds, args.clients, expected)
                    runs.append(
                        Run(store, route, n / args.seconds, other, pct(lat, 0.5) * 1000,
                            pct(lat, 0.99) * 1000)
                    )  # fmt: skip
        return runs
    finally:
        for proc, _ in procs.values():
            proc.terminate()


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def summary(runs: list[Run], crash: dict[str, list[RoundResult]]) -> dict[str, dict[str, float]]:
    out = {}
    for store in STORES:
        dlq = [r for r in runs if r.store == store and r.route == "with-dlq"]
        plain = [r for r in runs if r.store == store and r.route == "without-dlq"]
        rounds = crash[store]
        out[store] = {
            "durable_per_second": mean([r.per_second for r in dlq]),
            "not_stored": sum(r.other for r in dlq),
            "added_p50_ms": mean([r.p50_ms for r in dlq]) - mean([r.p50_ms for r in plain]),
            "added_p99_ms": mean([r.p99_ms for r in dlq]) - mean([r.p99_ms for r in plain]),
            "crash_rounds": len(rounds),
            "acknowledged": sum(r.acknowledged for r in rounds),
            "lost": sum(r.lost + r.corrupted for r in rounds),
        }
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 and a >= 0 else "n/a"


def markdown(runs: list[Run], s: dict[str, dict[str, float]], kill: list[RoundResult]) -> str:
    rows = [
        "| store | route | answers/s | p50 ms | p99 ms | other answers |",
        "|---|---|---|---|---|---|",
    ]
    rows += [
        f"| {r.store} | {r.route} | {r.per_second:.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f} "
        f"| {r.other} |"
        for r in runs
    ]
    q, sq = s["redis"], s["sqlite"]
    rows += [
        "",
        "| store | durable records/s | DLQ adds at p50 / p99 | crash rounds | acknowledged | lost |",
        "|---|---|---|---|---|---|",
    ]
    for name, v in (("SQLite", sq), ("Redis", q)):
        rows.append(
            f"| {name} | {v['durable_per_second']:.0f} | +{v['added_p50_ms']:.2f} / "
            f"{v['added_p99_ms']:+.2f} ms | {v['crash_rounds']:.0f} | {v['acknowledged']:.0f} "
            f"| {v['lost']:.0f} |"
        )
    rows.append(
        f"| Redis / SQLite | {ratio(q['durable_per_second'], sq['durable_per_second'])} "
        f"| {ratio(q['added_p50_ms'], sq['added_p50_ms'])} / "
        f"{ratio(q['added_p99_ms'], sq['added_p99_ms'])} | | | |"
    )
    rows.append(
        f"\nredis-server SIGKILLed and restarted mid-stream: {len(kill)} rounds, acknowledged "
        f"{sum(r.acknowledged for r in kill)} (of them after the restart "
        f"{sum(r.acknowledged_after_restart for r in kill)}), lost or corrupted "
        f"{sum(r.lost + r.corrupted for r in kill)}"
    )
    return "\n".join(rows)


async def main(args: argparse.Namespace) -> dict[str, object]:
    runner, up_port = await failing_upstream()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            d = Path(tmp)
            with redis_server(d / "redis-server") as server:
                runs = await throughput(args, up_port, d, server.url)
                stores: dict[str, Store] = {"sqlite": SQLITE, "redis": redis_store(server)}
                crash = {
                    name: await run_rounds(args.rounds, d / "crash", store=store)
                    for name, store in stores.items()
                }
                kill = await run_rounds(
                    args.redis_rounds, d / "crash", store=stores["redis"], kill="redis"
                )
    finally:
        await runner.cleanup()
    s = summary(runs, crash)
    print(
        f"full outage of a write route, {args.clients} concurrent clients, {args.seconds:g}s "
        f"per run, rotated over stores and routes, twice; crash rounds: {args.rounds} per "
        "store\n"
    )
    print(markdown(runs, s, kill))
    return {
        "options": vars(args),
        "runs": [asdict(r) for r in runs],
        "stores": s,
        "redis_over_sqlite": {
            k: s["redis"][k] / s["sqlite"][k] if s["sqlite"][k] else None
            for k in ("durable_per_second", "added_p50_ms", "added_p99_ms")
        },
        "redis_server_killed": [asdict(r) for r in kill],
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30, help="crash rounds per store")
    ap.add_argument("--redis-rounds", type=int, default=5, help="rounds killing redis-server")
    ap.add_argument("--json")
    a = ap.parse_args()
    out = asyncio.run(main(a))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))

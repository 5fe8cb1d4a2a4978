"""DLQ benchmark: durable records per second during a full outage of a write route, the p99
latency the DLQ write adds, and 30 crash rounds (SIGKILL mid-stream, count lost).

    python3 bench/dlq.py [--seconds 5] [--clients 32] [--rounds 30]

Everything runs on loopback against the real sidecar process and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.dlq_crash import failing_upstream, run_rounds
from tests.proc import SidecarProcess, free_port


def sqlite_dlq(directory: Path) -> str:
    """The ``dlq:`` section that keeps the records in a SQLite file in ``directory``, bounds
    raised out of the way. The only section ``config`` takes today; another store is another
    function returning its own section."""
    db = directory / "dlq.sqlite3"
    return f'dlq: {{path: "{db}", max_records: 10000000, max_bytes: 10GiB}}'


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


async def load(url: str, seconds: float, clients: int) -> tuple[int, list[float]]:
    ok = 0
    lat: list[float] = []
    end = time.monotonic() + seconds
    body = b'{"order": 1, "pad": "' + b"x" * 200 + b'"}'

    async def worker() -> None:
        nonlocal ok
        async with aiohttp.ClientSession() as s:
            while time.monotonic() < end:
                t = time.perf_counter()
                async with s.post(url, data=body) as r:
                    await r.read()
                    if r.status in (202, 503):
                        ok += 1
                lat.append(time.perf_counter() - t)

    await asyncio.gather(*(worker() for _ in range(clients)))
    return ok, lat


def pct(values: list[float], p: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(p * len(s)))] if s else 0.0


async def main(args: argparse.Namespace) -> dict[str, object]:
    runner, up_port = await failing_upstream()
    results: dict[str, object] = {}
    try:
        with tempfile.TemporaryDirectory() as d:
            port, admin_port = free_port(), free_port()
            cfg = Path(d) / "sidecar.yaml"
            cfg.write_text(config(up_port, port, admin_port, sqlite_dlq(Path(d))))
            proc = SidecarProcess(cfg)
            proc.start()
            await proc.wait_port(port)
            try:
                rows = []
                for label, path in (("without-dlq", "/plain/w"), ("with-dlq", "/dlq/w")) * 2:
                    n, lat = await load(
                        f"http://127.0.0.1:{port}{path}", args.seconds, args.clients
                    )
                    rows.append((label, n / args.seconds, pct(lat, 0.5), pct(lat, 0.99)))
            finally:
                proc.terminate()
        print(
            f"full outage of a write route, {args.clients} concurrent clients, "
            f"{args.seconds:g}s per run, A B A B\n"
        )
        print(f"{'route':<14}{'req/s':>10}{'p50 ms':>10}{'p99 ms':>10}")
        for label, rate, p50, p99 in rows:
            print(f"{label:<14}{rate:>10.0f}{p50 * 1000:>10.2f}{p99 * 1000:>10.2f}")
        with_dlq = [r for r in rows if r[0] == "with-dlq"]
        without = [r for r in rows if r[0] == "without-dlq"]
        durable = sum(r[1] for r in with_dlq) / len(with_dlq)
        added_p99 = sum(r[3] for r in with_dlq) / 2 - sum(r[3] for r in without) / 2
        print(
            f"\ndurable DLQ records per second (each acknowledged after its commit): {durable:.0f}"
        )
        print(f"p99 latency added by the DLQ write: {added_p99 * 1000:.2f} ms")
        results.update(durable_per_second=durable, added_p99_ms=added_p99 * 1000)

        with tempfile.TemporaryDirectory() as d:
            crash = await run_rounds(args.rounds, Path(d))
        acked = sum(r.acknowledged for r in crash)
        lost = sum(r.lost + r.corrupted for r in crash)
        print(f"\ncrash rounds: {args.rounds}, acknowledged {acked}, lost or corrupted {lost}")
        results.update(crash_rounds=args.rounds, acknowledged=acked, lost=lost)
    finally:
        await runner.cleanup()
    return results


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = asyncio.run(main(a))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2))

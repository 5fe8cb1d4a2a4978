"""The SQLite idempotency store's write-ahead log under sustained guarded writes: its size over
time at the proxy's peak guarded-write rate (issue 29 item 8: it grew without end, 216 MB after
7,500 writes; now it stays under ``sqlite.WAL_RESET_BYTES`` plus what one background checkpoint
lets through).

    python3 -m bench.idempotency_wal [--seconds 60] [--concurrency 64] [--body 200] [--every 1]

One real aiohttp app on loopback (answers at once), one real sidecar process with shipped
defaults and the SQLite store, driven closed-loop by ``--concurrency`` clients each sending
guarded POSTs with fresh keys as fast as the sidecar answers (its peak rate on this machine).
Every ``--every`` seconds it prints the writes so far, the rate and the WAL file's size. Bounded:
it stops by itself after ``--seconds`` (at most 600) and stops the processes it started.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.idempotency import config, start_app, storage
from tests.proc import SidecarProcess, free_port

SECONDS_MAX = 600.0


def wal_size(db: Path) -> int:
    try:
        return os.stat(str(db) + "-wal").st_size
    except FileNotFoundError:
        return 0


async def drive(url: str, seconds: float, concurrency: int, body: bytes) -> tuple[int, int]:
    """Guarded writes with fresh keys for ``seconds``: (answered 201, other statuses)."""
    done, other = 0, 0
    end = time.monotonic() + seconds

    async def client(s: aiohttp.ClientSession, n: int) -> None:
        nonlocal done, other
        i = 0
        while time.monotonic() < end:
            i += 1
            headers = {"Idempotency-Key": f"c{n}-{i}"}
            async with s.post(url, data=body, headers=headers) as r:
                await r.read()
            if r.status == 201:
                done += 1
            else:
                other += 1

    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as s:
        await asyncio.gather(*(client(s, n) for n in range(concurrency)))
    return done, other


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--body", type=int, default=200, help="request body bytes (answer is small)")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between two samples")
    args = ap.parse_args()
    seconds = min(args.seconds, SECONDS_MAX)
    runner, app_port = await start_app(0.0)
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        port, admin = free_port(), free_port()
        cfg = directory / "sidecar.yaml"
        cfg.write_text(config(app_port, port, admin, storage("sqlite", directory, "")))
        db = directory / "keys.sqlite3"
        proc = SidecarProcess(cfg)
        try:
            proc.start()
            await proc.wait_port(port, admin)
            body = b"x" * args.body
            work = asyncio.ensure_future(
                drive(f"http://127.0.0.1:{port}/guarded", seconds, args.concurrency, body)
            )
            samples: list[dict[str, float]] = []
            start = time.monotonic()
            while not work.done():
                await asyncio.wait({work}, timeout=args.every)
                sample = {"t": round(time.monotonic() - start, 1), "wal_bytes": wal_size(db)}
                samples.append(sample)
                print(json.dumps(sample), flush=True)
            done, other = work.result()
        finally:
            proc.terminate()
            await runner.cleanup()
    largest = max(s["wal_bytes"] for s in samples)
    print(
        json.dumps(
            {
                "seconds": seconds,
                "writes": done,
                "rate_per_s": round(done / seconds),
                "other_statuses": other,
                "wal_max_bytes": largest,
                "wal_max_mib": round(largest / (1 << 20), 1),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())

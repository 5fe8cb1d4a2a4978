"""Crash rounds for the DLQ: acknowledged records must survive SIGKILL.

Each round starts the real sidecar process (a write route with ``dlq: {respond: accepted}`` in
front of an upstream that always fails), sends writes from many concurrent clients, records every
acknowledged id (202 + dlq_id) with the SHA-256 of the body it sent, kills the process with
SIGKILL mid-stream, restarts it, and checks that every acknowledged id is in the file with an
intact body. Used by tests/dlq/test_dlq_crash.py (a few rounds) and bench/dlq.py (30 rounds).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sqlite3
import sys
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.proc import SidecarProcess, free_port


@dataclass
class RoundResult:
    acknowledged: int
    lost: int
    corrupted: int
    refused: int


def crash_config(up_port: int, port: int, admin_port: int, db: Path) -> str:
    return f"""
version: 1
name: crash
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin_port}"}}
dlq: {{path: "{db}"}}
defaults:
  breaker: {{min_sequences: 1000000}}
  budget: {{ratio: 1000}}
routes:
  - name: writes
    upstream: "http://127.0.0.1:{up_port}"
    retry: {{attempts: 1}}
    dlq: {{enabled: true, respond: accepted}}
"""


async def failing_upstream() -> tuple[web.AppRunner, int]:
    async def handle(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=503)

    app = web.Application()
    app.router.add_route("*", "/{t:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


async def one_round(
    workdir: Path, up_port: int, kill_after: float = 0.4, clients: int = 16
) -> RoundResult:
    port, admin_port = free_port(), free_port()
    db = workdir / "dlq.sqlite3"
    cfg = workdir / "sidecar.yaml"
    cfg.write_text(crash_config(up_port, port, admin_port, db))
    proc = SidecarProcess(cfg)
    proc.start()
    await proc.wait_port(port)
    acked: dict[str, str] = {}
    refused = 0
    stop = asyncio.Event()

    async def writer(n: int) -> None:
        nonlocal refused
        i = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while not stop.is_set():
                body = os.urandom(64) + f"{n}-{i}".encode()
                i += 1
                try:
                    async with s.post(f"http://127.0.0.1:{port}/w", data=body) as r:
                        payload = await r.read()
                        if r.status == 202:
                            acked[json.loads(payload)["dlq_id"]] = hashlib.sha256(body).hexdigest()
                        else:
                            refused += 1
                except (aiohttp.ClientError, TimeoutError, ConnectionError):
                    if stop.is_set():
                        return
                    await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(writer(n)) for n in range(clients)]
    await asyncio.sleep(kill_after)
    assert proc.proc is not None
    proc.proc.send_signal(signal.SIGKILL)  # mid-stream, no chance to flush anything
    proc.proc.wait()
    stop.set()
    await asyncio.gather(*tasks)
    # Restart on the same file: the integrity check must pass and keep everything.
    proc2 = SidecarProcess(cfg)
    proc2.start()
    await proc2.wait_port(port)
    proc2.terminate()
    conn = sqlite3.connect(db)
    try:
        found = {
            rid: hashlib.sha256(body).hexdigest()
            for rid, body in conn.execute("SELECT id, body FROM records")
        }
    finally:
        conn.close()
    lost = sum(1 for rid in acked if rid not in found)
    corrupted = sum(1 for rid, h in acked.items() if rid in found and found[rid] != h)
    return RoundResult(len(acked), lost, corrupted, refused)


async def run_rounds(rounds: int, workdir: Path) -> list[RoundResult]:
    runner, up_port = await failing_upstream()
    out = []
    try:
        for i in range(rounds):
            d = workdir / f"round-{i}"
            d.mkdir(parents=True, exist_ok=True)
            out.append(await one_round(d, up_port, kill_after=0.2 + 0.05 * (i % 8)))
    finally:
        await runner.cleanup()
    return out


if __name__ == "__main__":  # pragma: no cover - used via bench/dlq.py
    import tempfile

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    with tempfile.TemporaryDirectory() as d:
        res = asyncio.run(run_rounds(n, Path(d)))
    for i, r in enumerate(res):
        print(
            f"round {i:2}: acknowledged {r.acknowledged:5}  lost {r.lost}  corrupted {r.corrupted}"
        )
    print(f"total acknowledged {sum(r.acknowledged for r in res)}, lost {sum(r.lost for r in res)}")

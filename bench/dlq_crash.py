"""Crash rounds for the DLQ: acknowledged records must survive SIGKILL, on either store.

Each round starts the real sidecar process (a write route with ``dlq: {respond: accepted}`` in
front of an upstream that always fails), sends writes from many concurrent clients, records every
acknowledged id (202 + dlq_id) with the SHA-256 of the body it sent, kills a process with SIGKILL
mid-stream, and checks that every acknowledged id is in the store with an intact body.

- ``kill="sidecar"``: the sidecar is SIGKILLed, then started again on the same store (its start
  must pass), and the store is read: the SQLite file, or the fleet's Redis (``dlq: {backend:
  redis}``, a real redis-server with ``appendonly yes``, ``appendfsync always``).
- ``kill="redis"`` (Redis store only): redis-server itself is SIGKILLed mid-stream and started
  again on its directory (it loads its AOF) while the clients keep writing; the round goes on
  until the sidecar acknowledges again (bounded), then the store is read.

Used by tests/dlq/test_dlq_crash.py (a few rounds) and bench/dlq.py (30 rounds per store).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import sqlite3
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import aiohttp
import redis
from aiohttp import web

from tests.proc import SidecarProcess, free_port
from tests.redisserver import RedisServer

Kill = Literal["sidecar", "redis"]
REDIS_DOWN = 0.3  # seconds redis-server stays dead before it is started again
RECOVERY_BOUND = 30.0  # seconds for the sidecar to acknowledge again after Redis came back
PER_ROUND_BOUND = 120.0  # seconds any round may take, whatever hangs
FIRST_ACK_BOUND = 30.0  # seconds for the sidecar to acknowledge its first write of a round


@dataclass
class RoundResult:
    acknowledged: int
    lost: int
    corrupted: int
    refused: int
    acknowledged_after_restart: int = 0  # kill="redis": 202s once redis-server was back


Digests = dict[str, str]  # record id -> SHA-256 of its body


@dataclass(frozen=True)
class Store:
    """Where a round's sidecar keeps its DLQ: the config sections for a round's directory, and
    every record the store holds once the round is over (id -> body digest)."""

    name: str
    sections: Callable[[Path], str]
    read: Callable[[Path], Digests]
    server: RedisServer | None = None


def _sqlite_sections(workdir: Path) -> str:
    return f'dlq: {{path: "{workdir / "dlq.sqlite3"}"}}\n'


def _sqlite_read(workdir: Path) -> Digests:
    conn = sqlite3.connect(workdir / "dlq.sqlite3")
    try:
        return {
            rid: hashlib.sha256(body).hexdigest()
            for rid, body in conn.execute("SELECT id, body FROM records")
        }
    finally:
        conn.close()


SQLITE = Store("sqlite", _sqlite_sections, _sqlite_read)


def _prefix(workdir: Path) -> str:
    """One key prefix per round directory: the rounds share one redis-server, not records."""
    return f"bench-{workdir.name}:"


def redis_store(server: RedisServer) -> Store:
    """The fleet's Redis on ``server`` (``dlq: {backend: redis}``); read back with a client of
    its own, straight from the record hashes (``<prefix>dlq:rec:<id>``)."""

    def sections(workdir: Path) -> str:
        return (
            f'fleet: {{redis: {{url: "{server.url}", key_prefix: "{_prefix(workdir)}"}}}}\n'
            "dlq: {backend: redis}\n"
        )

    def read(workdir: Path) -> Digests:
        rec = _prefix(workdir) + "dlq:rec:"
        with redis.Redis(host="127.0.0.1", port=server.port, socket_timeout=10) as client:
            keys = sorted(client.scan_iter(match=rec + "*", count=1000))
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.hget(k, "body")
            bodies = pipe.execute()
        return {
            k.decode()[len(rec) :]: hashlib.sha256(b).hexdigest()
            for k, b in zip(keys, bodies, strict=True)
            if b is not None
        }

    return Store("redis", sections, read, server)


def crash_config(up_port: int, port: int, admin_port: int, sections: str) -> str:
    return f"""
version: 1
name: crash
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin_port}"}}
{sections}
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


class Writers:
    """``clients`` concurrent writers until ``stop``: every 202 kept as id -> body digest."""

    def __init__(self, port: int, clients: int) -> None:
        self.port = port
        self.acked: Digests = {}
        self.refused = 0
        self.stop = asyncio.Event()
        self.tasks = [asyncio.create_task(self._writer(n)) for n in range(clients)]

    async def _writer(self, n: int) -> None:
        i = 0
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
            while not self.stop.is_set():
                body = os.urandom(64) + f"{n}-{i}".encode()
                i += 1
                try:
                    async with s.post(f"http://127.0.0.1:{self.port}/w", data=body) as r:
                        payload = await r.read()
                        if r.status == 202:
                            digest = hashlib.sha256(body).hexdigest()
                            self.acked[json.loads(payload)["dlq_id"]] = digest
                        else:
                            self.refused += 1
                except (aiohttp.ClientError, TimeoutError, ConnectionError):
                    if self.stop.is_set():
                        return
                    await asyncio.sleep(0.01)

    async def first_ack(self, bound: float) -> None:
        """Wait until a write was acknowledged; an error when none was within ``bound`` s."""
        deadline = time.monotonic() + bound
        while not self.acked:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no write acknowledged within {bound:g} s")
            await asyncio.sleep(0.01)

    async def finish(self) -> None:
        self.stop.set()
        await asyncio.gather(*self.tasks)

    async def close(self) -> None:
        """Every writer ended, on any exit path (a no-op once they finished)."""
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


async def _kill_redis(server: RedisServer, writers: Writers) -> int:
    """SIGKILL redis-server, start it again after ``REDIS_DOWN``, and wait (bounded) until the
    sidecar acknowledges a write again: how many it acknowledged then."""
    server.kill()
    await asyncio.sleep(REDIS_DOWN)
    await asyncio.to_thread(server.start)  # loads its AOF; PING answers once it is done
    before = len(writers.acked)
    deadline = time.monotonic() + RECOVERY_BOUND
    while len(writers.acked) < before + 50 and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.1)  # a little more traffic after the recovery
    return len(writers.acked) - before


async def one_round(
    workdir: Path,
    up_port: int,
    kill_after: float = 0.4,
    clients: int = 16,
    *,
    store: Store = SQLITE,
    kill: Kill = "sidecar",
) -> RoundResult:
    if kill == "redis" and store.server is None:
        raise ValueError("kill='redis' needs the Redis store")
    port, admin_port = free_port(), free_port()
    cfg = workdir / "sidecar.yaml"
    cfg.write_text(crash_config(up_port, port, admin_port, store.sections(workdir)))
    proc = SidecarProcess(cfg)
    proc.start()
    writers: Writers | None = None
    after = 0
    try:
        await proc.wait_port(port)
        writers = Writers(port, clients)
        # The kill comes ``kill_after`` past the first acknowledged write, never before it: a
        # round killed before anything was stored proves nothing (on a loaded machine the first
        # 202 may take longer than any fixed pause).
        await writers.first_ack(FIRST_ACK_BOUND)
        await asyncio.sleep(kill_after)
        assert proc.proc is not None
        if kill == "sidecar":
            proc.proc.send_signal(signal.SIGKILL)  # mid-stream, no chance to flush anything
            proc.proc.wait()
        else:
            assert store.server is not None
            after = await _kill_redis(store.server, writers)
        await writers.finish()
    finally:
        if writers is not None:
            await writers.close()
        proc.terminate()
    # Start again on the same store: its start must pass and keep everything.
    proc2 = SidecarProcess(cfg)
    proc2.start()
    try:
        await proc2.wait_port(port)
    finally:
        proc2.terminate()
    found = store.read(workdir)
    acked = writers.acked
    lost = sum(1 for rid in acked if rid not in found)
    corrupted = sum(1 for rid, h in acked.items() if rid in found and found[rid] != h)
    return RoundResult(len(acked), lost, corrupted, writers.refused, after)


async def run_rounds(
    rounds: int, workdir: Path, *, store: Store = SQLITE, kill: Kill = "sidecar"
) -> list[RoundResult]:
    runner, up_port = await failing_upstream()
    out = []
    try:
        for i in range(rounds):
            d = workdir / f"{store.name}-{kill}-round-{i}"
            d.mkdir(parents=True, exist_ok=True)
            kill_after = 0.2 + 0.05 * (i % 8)
            r = one_round(d, up_port, kill_after, store=store, kill=kill)
            out.append(await asyncio.wait_for(r, PER_ROUND_BOUND))
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

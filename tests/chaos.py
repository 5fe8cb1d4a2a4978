"""The invariant ("chaos") run: a real sidecar, a misbehaving upstream and misbehaving clients,
all on loopback in one event loop, for a bounded time; then it checks that nothing was kept.

Faults, chosen at random per request (seeded): upstream 200 / 503 / 503 with Retry-After /
reset before the head / hang past the per-try timeout / death mid-body / a slow body / a large
streamed body; client aborts mid-request and mid-upload, readers that stop reading, keyed and
keyless POSTs to a DLQ route answering 202, reloads and kill-switch flips.

Invariants checked afterwards (``check``): every bulkhead is empty, every pooled upstream
connection is idle or closed, no breaker is wedged (the upstream turned healthy, each route
closes again), asyncio tasks and file descriptors are back to their baseline, RSS is back near
its baseline, and every DLQ record the client was told about holds the full body it sent.

Used by tests/adversarial/test_chaos.py (about a minute) and bench/chaos.py (a soak of any length).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import socket
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web

from sidecar.app import Sidecar
from sidecar.config.parse import parse_text
from sidecar.retry.breaker import State

BIG = 256 * 1024
UPLOAD_LIMIT = 16 * 1024  # max_body_bytes: larger uploads are streamed


def config_text(upstream: str, dlq_path: str, attempts: int) -> str:
    return f"""
version: 1
name: chaos-edge
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0"}}
dlq: {{path: "{dlq_path}"}}
limits: {{send_timeout: 300ms, body_idle_timeout: 1s, header_timeout: 2s}}
upstream_pool: {{max_connections: 64, wait_timeout: 500ms}}
defaults:
  timeout: 2s
  retry:
    attempts: {attempts}
    per_try_timeout: 300ms
    backoff: {{strategy: full_jitter, base: 5ms, max: 20ms}}
    max_body_bytes: {UPLOAD_LIMIT}
    retry_after: {{honor: true, max: 50ms}}
  breaker: {{min_sequences: 30, failure_ratio: 0.6, window: 2s, open_for: 200ms,
            half_open_probes: 2}}
  bulkhead: {{max_concurrent: 40, queue_timeout: 200ms}}
routes:
  - name: writes
    match: {{path_prefix: /w}}
    upstream: "{upstream}"
    dlq: {{enabled: true, respond: accepted}}
  - name: reads
    upstream: "{upstream}"
"""


@dataclass
class FaultyUpstream:
    healthy: bool = False
    rng: random.Random = field(default_factory=lambda: random.Random(1))
    served: Counter[str] = field(default_factory=Counter)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        fault = (
            "ok"
            if self.healthy
            else self.rng.choice(
                ["ok", "ok", "ok", "503", "503ra", "reset", "hang", "midbody", "slow", "big"]
            )
        )
        self.served[fault] += 1
        if fault == "503":
            return web.Response(status=503, text="down")
        if fault == "503ra":
            return web.Response(status=503, headers={"Retry-After": "0"})
        if fault == "reset":
            assert request.transport is not None
            request.transport.abort()
            return web.Response(status=500)
        if fault == "hang":
            await asyncio.sleep(0.5)
            return web.Response(text="late")
        if fault in ("midbody", "slow", "big"):
            resp = web.StreamResponse(headers={"Content-Length": str(BIG)})
            await resp.prepare(request)
            for i in range(0, BIG, 32 * 1024):
                if fault == "midbody" and i >= BIG // 2:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                if fault == "slow":
                    await asyncio.sleep(0.02)
                await resp.write(b"b" * (32 * 1024))
            await resp.write_eof()
            return resp
        return web.Response(text="ok")


@dataclass
class Told:
    """What the clients were told about DLQ records: id -> the body that was sent."""

    records: dict[str, bytes] = field(default_factory=dict)
    outcomes: Counter[str] = field(default_factory=Counter)


async def _client_op(
    rng: random.Random, session: aiohttp.ClientSession, base: str, port: int, told: Told
) -> None:
    op = rng.choice(["get", "get", "get", "abort", "post", "keyless", "upload", "slowread"])
    told.outcomes[op] += 1
    try:
        if op == "get":
            async with session.get(base + "/r/" + str(rng.random())) as r:
                await r.read()
        elif op == "abort":  # the client leaves mid-request
            async with session.get(
                base + "/r/abort", timeout=aiohttp.ClientTimeout(total=rng.uniform(0.01, 0.3))
            ) as r:
                await r.read()
        elif op in ("post", "keyless"):
            body = os.urandom(rng.choice([10, 1000, UPLOAD_LIMIT - 1]))
            headers = {"Idempotency-Key": str(rng.random())} if op == "post" else {}
            async with session.post(base + "/w/x", data=body, headers=headers) as r:
                await r.read()
                rid = r.headers.get("x-retry-dlq-id")
                if rid is not None and r.headers.get("x-retry-dlq") == "stored":
                    told.records[rid] = body
        elif op == "upload":  # a streamed upload, sometimes aborted half-way
            reader, w = await asyncio.open_connection("127.0.0.1", port)
            size = UPLOAD_LIMIT * 4
            body = os.urandom(size)
            w.write(b"POST /w/up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size)
            w.write(body[: size // 2])
            await w.drain()
            if rng.random() < 0.5:
                w.transport.abort()
                return
            w.write(body[size // 2 :])
            await w.drain()
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 3)
            w.close()
            fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
            raw_id = fields.get(b"x-retry-dlq-id")
            if raw_id is not None and fields.get(b"x-retry-dlq") == b"stored":
                told.records[raw_id.decode()] = body
        else:  # a reader that stops reading a large response
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.setblocking(False)
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, ("127.0.0.1", port))
            await loop.sock_sendall(sock, b"GET /r/big HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(rng.uniform(0.1, 0.8))
            sock.close()
    except (aiohttp.ClientError, TimeoutError, OSError, asyncio.IncompleteReadError):
        told.outcomes[op + "-error"] += 1


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@dataclass
class Report:
    requests: int
    outcomes: dict[str, int]
    upstream: dict[str, int]
    dlq_told: int
    baseline: dict[str, float]
    after: dict[str, float]
    problems: list[str]


async def run(seconds: float, seed: int = 7, concurrency: int = 40) -> Report:
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="chaos-"))
    faulty = FaultyUpstream(rng=random.Random(seed + 1))
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", faulty.handle)
    up_runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
    await up_runner.setup()
    site = web.TCPSite(up_runner, "127.0.0.1", 0)
    await site.start()
    up_url = f"http://127.0.0.1:{up_runner.addresses[0][1]}"
    cfg_path = tmp / "sidecar.yaml"
    cfg_path.write_text(config_text(up_url, str(tmp / "dlq.sqlite3"), 3))
    sc = Sidecar(parse_text(cfg_path.read_text(), str(cfg_path)), config_path=str(cfg_path))
    await sc.start()
    problems: list[str] = []
    try:
        base = f"http://127.0.0.1:{sc.proxy_port}"
        gc.collect()
        baseline = {"tasks": len(asyncio.all_tasks()), "fds": _fds(), "rss_mb": _rss_mb()}
        told = Told()
        stop_at = time.monotonic() + seconds
        count = 0

        async def worker() -> None:
            nonlocal count
            connector = aiohttp.TCPConnector(limit=4)
            async with aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=5)
            ) as session:
                while time.monotonic() < stop_at:
                    count += 1
                    await _client_op(rng, session, base, sc.proxy_port, told)

        async def operator() -> None:  # reloads and kill-switch flips
            attempts = 3
            while time.monotonic() < stop_at:
                await asyncio.sleep(rng.uniform(0.2, 0.6))
                if rng.random() < 0.5:
                    attempts = 2 if attempts == 3 else 3
                    cfg_path.write_text(config_text(up_url, str(tmp / "dlq.sqlite3"), attempts))
                    assert sc.reloader is not None
                    await sc.reloader.reload("chaos")
                else:
                    now, wall = sc.clock.monotonic(), sc.clock.wall()
                    scope = rng.choice(["global", "route:reads", "route:writes"])
                    if sc.kill.covers(scope.removeprefix("route:"), now):
                        sc.kill.lift(scope)
                    else:
                        sc.kill.set(scope, 1.0, "chaos", "chaos", now, wall)

        async with asyncio.TaskGroup() as tg:
            for _ in range(concurrency):
                tg.create_task(worker())
            tg.create_task(operator())

        # Quiet: the upstream heals, switches go, the send timeouts and idle timers run out.
        faulty.healthy = True
        for scope in ("global", "route:reads", "route:writes"):
            sc.kill.lift(scope)
        await asyncio.sleep(1.0)
        async with aiohttp.ClientSession() as session:
            for name, path in (("reads", "/r/heal"), ("writes", "/w/heal")):
                breaker = sc.states.get(name).breaker
                for _ in range(100):  # a bounded number of tries, never a time threshold
                    async with session.get(base + path) as r:
                        await r.read()
                    if breaker.state is State.CLOSED and r.status == 200:
                        break
                    await asyncio.sleep(0.05)
                if breaker.state is not State.CLOSED:
                    problems.append(f"breaker of {name} wedged {breaker.state.value}")
        after: dict[str, float] = {}
        for _ in range(100):  # connections close and handler tasks finish
            await asyncio.sleep(0.1)
            gc.collect()
            after = {"tasks": len(asyncio.all_tasks()), "fds": _fds(), "rss_mb": _rss_mb()}
            if after["tasks"] <= baseline["tasks"] and after["fds"] <= baseline["fds"]:
                break
        for name, st in sc.states.items():
            if st.bulkhead.in_flight != 0:
                problems.append(f"bulkhead of {name} holds {st.bulkhead.in_flight}")
        for key, stats in sc.client.stats().items():
            if stats.total != stats.idle or stats.waiting:
                problems.append(f"pool {key}: {stats}")
        if after["tasks"] > baseline["tasks"]:
            problems.append(f"tasks {baseline['tasks']} -> {after['tasks']}")
        if after["fds"] > baseline["fds"]:
            problems.append(f"descriptors {baseline['fds']} -> {after['fds']}")
        if after["rss_mb"] > baseline["rss_mb"] + 60:
            problems.append(f"RSS {baseline['rss_mb']:.0f} -> {after['rss_mb']:.0f} MB")
        assert sc.dlq is not None
        for rid, body in told.records.items():
            rec = await sc.dlq.get(rid)
            if rec is None:
                problems.append(f"acknowledged DLQ record {rid} is missing")
            elif rec["body_bytes"] != body:
                problems.append(
                    f"DLQ record {rid} holds {len(rec['body_bytes'])} bytes, {len(body)} sent"
                )
        return Report(
            count,
            dict(told.outcomes),
            dict(faulty.served),
            len(told.records),
            baseline,
            after,
            problems,
        )
    finally:
        await sc.stop()
        await up_runner.cleanup()

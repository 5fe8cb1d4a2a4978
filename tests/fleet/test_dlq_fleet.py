"""The DLQ on the fleet's Redis (``dlq: {backend: redis}``), from outside: sidecars sharing a
real redis-server (tests/redisserver.py). Records written through one sidecar are listed,
shown, replayed and purged through another; two real sidecar processes redriving the same
records deliver each exactly once; a paused Redis gives ``x-retry-dlq: unavailable`` while the
proxy keeps answering; the start-up check's warning shows in ``GET /status``; the redrive
cancelled mid-replay gives its claim back; every Redis connection is closed at stop."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import reply
from tests.proc import SidecarProcess, free_port
from tests.redisserver import RedisServer, redis_server  # noqa: F401 (the fixture)
from tests.wait import until, until_async

# Real sidecar processes and a real redis-server each: the full tier.
pytestmark = pytest.mark.slow


def fleet_yaml(
    up_url: str,
    redis_url: str,
    *,
    redrive: bool = False,
    listen: str = "127.0.0.1:0",
    admin: str = "127.0.0.1:0",
    timeout: str = "5s",
) -> str:
    on = "true" if redrive else "false"
    return f"""
version: 1
listen: "{listen}"
admin: {{listen: "{admin}"}}
fleet:
  redis: {{url: "{redis_url}", timeout: 500ms}}
dlq: {{backend: redis}}
defaults:
  timeout: {timeout}
  retry: {{attempts: 1}}
  breaker: {{min_sequences: 100000}}
  dlq: {{enabled: true, max_replays: 1000, replay_rate: 1000, redrive: {{enabled: {on}, interval: 1s}}}}
routes:
  - name: main
    upstream: "{up_url}"
"""


def client_list(port: int) -> list[str]:
    """The names of the clients connected to the Redis on ``port`` (CLIENT LIST)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"CLIENT LIST\r\n")
        data = b""
        while not data.endswith(b"\r\n") or data.count(b"\r\n") < 2:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    lines = data.decode().split("\r\n", 1)[1].splitlines()
    return [f.split("=", 1)[1] for line in lines for f in line.split() if f.startswith("name=")]


async def redis_command(server: RedisServer, name: str, *args: Any) -> Any:
    """One command on the test's Redis, through a client of its own."""
    from redis.asyncio import Redis

    r = Redis.from_url(server.url)
    try:
        return await r.execute_command(name, *args)
    finally:
        await r.aclose()


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def admin(sc: Any) -> str:
    return f"http://127.0.0.1:{sc.sidecar.admin_port}"


async def test_any_sidecar_lists_shows_replays_and_purges_any_record(
    upstream_factory: Any, sidecar_factory: Any, client: aiohttp.ClientSession,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    up = await upstream_factory(reply(503))
    a = await sidecar_factory(fleet_yaml(up.url, redis_server.url))
    b = await sidecar_factory(fleet_yaml(up.url, redis_server.url))
    ids = []
    for i in range(3):
        async with client.put(a.url + "/o", data=b"%d" % i) as resp:
            assert resp.status == 503 and resp.headers["x-retry-dlq"] == "stored"
            ids.append(resp.headers["x-retry-dlq-id"])
    async with client.get(admin(b) + "/dlq?order=oldest") as resp:
        assert [r["id"] for r in (await resp.json())["records"]] == ids
    async with client.get(admin(b) + f"/dlq/{ids[1]}") as resp:
        assert (await resp.json())["body"] == "1"
    up.script = [reply(200)]
    async with client.post(admin(b) + f"/dlq/{ids[0]}/replay") as resp:
        assert (await resp.json())["status"] == "delivered"
    async with client.post(admin(a) + f"/dlq/{ids[0]}/replay") as resp:
        assert resp.status == 409  # delivered already, whichever sidecar is asked
    async with client.delete(admin(b) + f"/dlq/{ids[2]}") as resp:
        assert resp.status == 200
    async with client.get(admin(a) + f"/dlq/{ids[2]}") as resp:
        assert resp.status == 404
    async with client.get(admin(a) + "/status") as resp:
        process = (await resp.json())["process"]
        assert process["dlq"] == "open" and "dlq:" in process["dlq_path"]
        assert process["dlq_warning"] is None  # the test Redis fsyncs every write

    async def gauge_shows_one_pending() -> bool:
        async with client.get(admin(a) + "/metrics") as resp:
            return 'retry_sidecar_dlq_records{status="pending"} 1' in await resp.text()

    await until_async(gauge_shows_one_pending, "the fleet-wide count in the gauge")


async def test_a_paused_redis_gives_unavailable_and_the_proxy_answers(
    upstream_factory: Any, sidecar_factory: Any, client: aiohttp.ClientSession,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(fleet_yaml(up.url, redis_server.url))
    async with client.put(sc.url + "/o", data=b"before") as resp:
        assert resp.headers["x-retry-dlq"] == "stored"
    redis_server.pause()
    try:
        told: list[str] = []
        for i in range(5):
            async with client.put(sc.url + "/o", data=b"during %d" % i) as resp:
                assert resp.status == 503  # what the route answers without a DLQ
                told.append(resp.headers["x-retry-dlq"])
                assert "x-retry-dlq-id" not in resp.headers
        assert set(told) == {"unavailable"}
    finally:
        redis_server.resume()

    async def stored_again() -> bool:
        async with client.put(sc.url + "/o", data=b"after") as resp:
            return resp.headers["x-retry-dlq"] == "stored"

    await until_async(stored_again, "the DLQ to take records again")
    async with client.get(admin(sc) + "/dlq?limit=100") as resp:
        bodies = [r["id"] for r in (await resp.json())["records"]]
    # Nothing acknowledged is missing; what was refused may exist (cut off after it was sent:
    # at-least-once), never the other way round.
    assert len(bodies) >= 2


async def test_the_durability_warning_shows_in_status(
    upstream_factory: Any, sidecar_factory: Any, client: aiohttp.ClientSession,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    from redis.asyncio import Redis

    r = Redis.from_url(redis_server.url)
    try:
        await r.config_set("appendfsync", "everysec")
    finally:
        await r.aclose()
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(fleet_yaml(up.url, redis_server.url))
    await until(lambda: sc.sidecar.dlqs.warning is not None, "the start-up check")
    async with client.get(admin(sc) + "/status") as resp:
        warning = (await resp.json())["process"]["dlq_warning"]
    assert "appendfsync everysec" in warning
    async with client.get(admin(sc) + "/") as resp:
        assert "appendfsync everysec" in await resp.text()


async def test_the_redrive_cancelled_mid_replay_gives_its_claim_back_and_stop_closes_redis(
    upstream_factory: Any, client: aiohttp.ClientSession,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    hang = asyncio.Event()
    asked: list[str] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        if request.headers.get("x-retry-replay"):
            asked.append(request.headers["x-retry-replay"])
            await hang.wait()  # the replay is in flight, its claim held
        return web.Response(status=503)

    up = await upstream_factory(upstream)
    sc = Sidecar(parse_text(fleet_yaml(up.url, redis_server.url, redrive=True, timeout="60s")))
    await sc.start()
    try:
        async with client.put(f"http://127.0.0.1:{sc.proxy_port}/o", data=b"x") as resp:
            rid = resp.headers["x-retry-dlq-id"]
        await until(lambda: asked == [rid], "the redrive to send the record", timeout=30)
        store = sc.dlq
        assert store is not None
        got = await store.get(rid)
        assert got is not None and got["claimed_by"] is not None
        task = next(t for t in asyncio.all_tasks() if t.get_name() == "dlq-redrive")
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

        async def released() -> bool:
            got = await store.get(rid)
            assert got is not None
            return got["claimed_by"] is None and got["reached_upstream"] is True

        await until_async(released, "the claim given back, marked possibly sent")
        assert "retry-sidecar" in client_list(redis_server.port)
    finally:
        hang.set()
        await sc.stop()
    assert "retry-sidecar" not in client_list(redis_server.port)


async def fleet_process(
    tmp_path: Path, name: str, up_url: str, redis_url: str, **kw: Any
) -> tuple[SidecarProcess, int, int]:
    """A real sidecar process on ``fleet_yaml`` (``HOSTNAME`` set to ``name``), once both its
    ports listen: the process, its proxy port and its admin port. The caller stops it."""
    port, admin_port = free_port(), free_port()
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(
        fleet_yaml(
            up_url, redis_url, listen=f"127.0.0.1:{port}", admin=f"127.0.0.1:{admin_port}", **kw
        )
    )
    p = SidecarProcess(cfg, env={"HOSTNAME": name})
    p.start()
    try:
        await p.wait_port(port, admin_port)
    except BaseException:
        p.terminate()
        raise
    return p, port, admin_port


BURST = 300  # failing writes at once: well over the link's CALLS_MAX (64) and redis-py's 100


async def test_a_burst_of_failing_writes_over_the_pool_size_is_all_stored(
    upstream_factory: Any, tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    """An outage fails BURST writes at once on a healthy Redis: every one is stored (202 /
    ``x-retry-dlq: stored``), none refused as ``unavailable`` for want of a pooled connection
    (a redis-py pool capped at 100 raised "Too many connections", which also paused the link)."""
    up = await upstream_factory(reply(503))
    p, port, _ = await fleet_process(tmp_path, "burst", up.url, redis_server.url)
    try:
        connector = aiohttp.TCPConnector(limit=BURST)
        async with aiohttp.ClientSession(connector=connector) as s:

            async def write(i: int) -> str:
                url = f"http://127.0.0.1:{port}/orders"
                async with s.post(url, data=b"order-%d" % i) as r:
                    await r.read()
                    return r.headers.get("x-retry-dlq", "none")

            told = Counter(await asyncio.gather(*(write(i) for i in range(BURST))))
            assert told == Counter({"stored": BURST})
        held = await redis_command(
            redis_server, "hget", "retry-sidecar:dlq:meta:counts", "held_records"
        )
        assert int(held) == BURST
    finally:
        assert p.terminate() == 0


async def test_a_redis_that_comes_back_empty_is_logged_counted_and_shown(
    upstream_factory: Any, tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    """Records acknowledged, then Redis restarted without its files: the sidecar says that
    acknowledged records may have been lost (an ERROR line, dlq_file_recreated_total, the DLQ
    warning in GET /status) and goes on storing."""
    up = await upstream_factory(reply(503))
    p, port, admin_port = await fleet_process(tmp_path, "empty", up.url, redis_server.url)
    base = f"http://127.0.0.1:{admin_port}"
    try:
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                async with s.put(f"http://127.0.0.1:{port}/o", data=b"%d" % i) as r:
                    assert r.headers["x-retry-dlq"] == "stored"

            async def epoch_known() -> bool:
                async with s.get(base + "/metrics") as r:
                    return 'retry_sidecar_dlq_records{status="pending"} 3' in await r.text()

            await until_async(epoch_known, "a counts read after the writes")
            async with s.get(base + "/metrics") as r:
                assert "retry_sidecar_dlq_file_recreated_total 0" in await r.text()
            redis_server.kill()
            shutil.rmtree(redis_server.directory / "appendonlydir")
            redis_server.start()

            async def warned() -> bool:
                async with s.get(base + "/status") as r:
                    warning = (await r.json())["process"]["dlq_warning"]
                return warning is not None and "may have been lost" in warning

            await until_async(warned, "the loss shown in GET /status")
            async with s.get(base + "/metrics") as r:
                assert "retry_sidecar_dlq_file_recreated_total 1" in await r.text()
            async with s.put(f"http://127.0.0.1:{port}/o", data=b"after") as r:
                assert r.headers["x-retry-dlq"] == "stored"
        assert await redis_command(redis_server, "exists", "retry-sidecar:dlq:meta:epoch") == 1
    finally:
        assert p.terminate() == 0
    errors = [line for line in p.stderr().splitlines() if "may have been lost" in line]
    assert len(errors) == 1 and '"level": "error"' in errors[0]


async def test_sidecars_stopped_cleanly_leave_no_consumer_behind(
    upstream_factory: Any, tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    """Start and stop a redriving sidecar three times: each joins the route's redrive group
    and, holding nothing, leaves it at its clean stop; the group does not grow."""
    up = await upstream_factory(reply(200))
    stream = "retry-sidecar:dlq:main"

    async def consumers() -> list[str]:
        try:
            rows = await redis_command(redis_server, "xinfo", "consumers", stream, "redrive")
        except Exception:  # no stream or group yet
            return []
        named = [{_text(k): v for k, v in r.items()} for r in rows]  # parsed by redis-py
        return [_text(r["name"]) for r in named]

    for i in range(3):
        name = f"r{i}"
        p, _, _ = await fleet_process(tmp_path, name, up.url, redis_server.url, redrive=True)
        try:

            async def joined(name: str = name) -> bool:
                return any(c.startswith(name + ":") for c in await consumers())

            await until_async(joined, "the sidecar to join the redrive group")
        finally:
            assert p.terminate() == 0
        assert await consumers() == []


async def test_two_sidecar_processes_deliver_every_record_exactly_once(
    upstream_factory: Any, tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    """Two real sidecar processes on one Redis, both redriving (consumer group), while batch
    replays are fired at both admin APIs: every record is delivered, none twice."""
    delivered: list[str] = []
    healthy = False

    async def upstream(request: web.Request) -> web.StreamResponse:
        if not healthy:
            return web.Response(status=503)
        await asyncio.sleep(0.05)  # widen every window between claim and answer
        rid = request.headers.get("x-retry-replay")
        if rid:
            delivered.append(rid)
        return web.Response(status=200)

    up = await upstream_factory(upstream)
    procs, ports = [], []
    for i in range(2):
        port, admin_port = free_port(), free_port()
        cfg = tmp_path / f"sidecar{i}.yaml"
        cfg.write_text(
            fleet_yaml(
                up.url,
                redis_server.url,
                redrive=True,
                listen=f"127.0.0.1:{port}",
                admin=f"127.0.0.1:{admin_port}",
            )
        )
        p = SidecarProcess(cfg)
        p.start()
        procs.append(p)
        ports.append((port, admin_port))
    try:
        for p, (port, admin_port) in zip(procs, ports, strict=True):
            await p.wait_port(port, admin_port)
        ids = []
        async with aiohttp.ClientSession() as s:
            for i in range(16):
                async with s.post(
                    f"http://127.0.0.1:{ports[i % 2][0]}/orders",
                    data=b"%d" % i,
                    headers={"Idempotency-Key": f"order-{i}"},
                ) as r:
                    assert r.headers["x-retry-dlq"] == "stored"
                    ids.append(r.headers["x-retry-dlq-id"])
            healthy = True
            batches = [
                s.post(f"http://127.0.0.1:{a}/dlq/replay", json={"limit": 100})
                for _ in range(2)
                for _, a in ports
            ]
            for resp in await asyncio.gather(*batches):
                assert resp.status == 200
                resp.release()

            async def all_delivered() -> bool:
                url = f"http://127.0.0.1:{ports[1][1]}/dlq?status=delivered&limit=100"
                async with s.get(url) as r:
                    return len((await r.json())["records"]) == len(ids)

            await until_async(all_delivered, "every record delivered", timeout=30)
            await asyncio.sleep(1.5)  # a redrive round more on each process
        counts = Counter(delivered)
        assert sorted(counts) == sorted(ids)
        assert [rid for rid, n in counts.items() if n > 1] == []
    finally:
        for p in procs:
            assert p.terminate() == 0


async def test_a_sidecar_killed_holding_records_leaves_them_to_another_after_the_lease(
    upstream_factory: Any, tmp_path: Path,
    redis_server: RedisServer,  # noqa: F811
) -> None:  # fmt: skip
    """Sidecar A redrives, sends the first record (the app holds it) and has read the others
    into its pending entries; A is SIGKILLed. Sidecar B takes them all over once the claim
    lease (the route's 1 s timeout + 45 s) ran out -- the claimed record by its expired claim
    (marked possibly reached), the others by XAUTOCLAIM -- and each is delivered once."""
    hold = True
    arrived: list[str] = []
    answered: list[str] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("x-retry-replay")
        if rid is None:
            return web.Response(status=503)
        arrived.append(rid)
        if hold:
            await asyncio.Event().wait()  # until A dies and the connection with it
        answered.append(rid)
        return web.Response(status=200)

    up = await upstream_factory(upstream)

    def process(name: str, redrive: bool) -> tuple[SidecarProcess, int, int]:
        port, admin_port = free_port(), free_port()
        cfg = tmp_path / f"{name}.yaml"
        cfg.write_text(
            fleet_yaml(
                up.url,
                redis_server.url,
                redrive=redrive,
                timeout="1s",
                listen=f"127.0.0.1:{port}",
                admin=f"127.0.0.1:{admin_port}",
            )
        )
        p = SidecarProcess(cfg, env={"HOSTNAME": name})
        p.start()
        return p, port, admin_port

    a, a_port, a_admin = process("a", redrive=False)
    b: SidecarProcess | None = None
    try:
        await a.wait_port(a_port, a_admin)
        ids = []
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                async with s.put(f"http://127.0.0.1:{a_port}/o", data=b"%d" % i) as r:
                    assert r.headers["x-retry-dlq"] == "stored"
                    ids.append(r.headers["x-retry-dlq-id"])
        assert a.terminate() == 0
        a, a_port, a_admin = process("a", redrive=True)  # the same records, now redriven
        await a.wait_port(a_port, a_admin)
        await until(lambda: arrived == ids[:1], "A to send the first record", timeout=30)
        assert a.proc is not None
        a.proc.kill()
        a.proc.wait()
        hold = False
        b, b_port, b_admin = process("b", redrive=True)
        await b.wait_port(b_port, b_admin)
        await until(lambda: sorted(answered) == sorted(ids), "B to deliver all", timeout=90)
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{b_admin}/dlq/{ids[0]}") as r,
        ):
            first = await r.json()
        assert first["status"] == "delivered" and first["reached_upstream"] is True
        assert Counter(answered) == Counter(ids)  # each delivered once
    finally:
        for p in (a, b):
            if p is not None and p.proc is not None and p.proc.poll() is None:
                p.terminate()

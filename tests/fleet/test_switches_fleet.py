"""Fleet kill switches across real sidecar processes: two or three sidecars share one
real redis-server with ``fleet.killswitch: true``. A switch set through one is seen by the
others, lifted through another is lifted everywhere, reaches a sidecar started later, survives
a Redis killed (kept, ``fleet_connected{use="killswitch"}`` 0) and converges once it is back."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.proc import SidecarProcess, free_port
from tests.redisserver import RedisServer
from tests.wait import until_async

pytestmark = pytest.mark.slow
CONTRACT = 2.0  # seconds: a change reaches every sidecar within this
BOUND = CONTRACT + 3.0  # the wait's bound: the contract plus margin for a loaded machine


async def start(procs: list[SidecarProcess], tmp_path: Path, redis: RedisServer, name: str) -> int:
    """A sidecar named ``name`` (its HOSTNAME) sharing ``redis``; its admin port."""
    port, admin = free_port(), free_port()
    directory = tmp_path / name
    directory.mkdir()
    cfg = directory / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n'
        f'fleet: {{redis: {{url: "{redis.url}", timeout: 250ms}}, killswitch: true}}\n'
        'routes: [{name: orders, upstream: "http://127.0.0.1:9"}]\n'
    )
    proc = SidecarProcess(cfg, env={"HOSTNAME": name})
    procs.append(proc)
    proc.start()
    await proc.wait_port(port, admin)
    return admin


async def call(method: str, admin: int, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as s:
        url = f"http://127.0.0.1:{admin}{path}"
        async with s.request(method, url, json=body) as r:
            return r.status, await r.json()


async def switches(admin: int) -> list[dict[str, Any]]:
    status, body = await call("GET", admin, "/killswitch")
    assert status == 200
    return [s for s in body["switches"] if s["source"] == "fleet"]


async def scopes(admin: int) -> set[str]:
    return {s["scope"] for s in await switches(admin)}


async def fleet_gauge(admin: int) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{admin}/metrics") as r:
        text = await r.text()
    [line] = [x for x in text.splitlines() if x.startswith("retry_sidecar_fleet_connected{")]
    assert line.startswith('retry_sidecar_fleet_connected{use="killswitch"} ')  # the one use on
    return line.split()[1]


async def seen(admins: list[int], want: set[str], what: str) -> None:
    async def all_agree() -> bool:
        return all([await scopes(a) == want for a in admins])

    await until_async(all_agree, what, timeout=BOUND)


GLOBAL = {"scope": "global", "ttl": "15m", "reason": "payments down"}


async def test_set_on_one_is_seen_on_the_other_and_lifted_on_the_other_lifts_it(
    tmp_path: Path, redis: RedisServer, procs: list[SidecarProcess]
) -> None:
    a = await start(procs, tmp_path, redis, "pod-a")
    b = await start(procs, tmp_path, redis, "pod-b")
    status, body = await call("PUT", a, "/killswitch", GLOBAL)
    assert (status, body["source"], body["set_on"]) == (200, "fleet", "pod-a")
    await seen([a, b], {"global"}, "the switch set on A on both")
    [on_b] = await switches(b)
    assert {k: on_b[k] for k in ("reason", "set_on", "set_by")} == {
        "reason": "payments down",
        "set_on": "pod-a",
        "set_by": "127.0.0.1",
    }
    assert on_b["expires_at"] == body["expires_at"]
    status, body = await call("DELETE", b, "/killswitch?scope=global")
    assert (status, body["lifted"]) == (200, "global")
    await seen([a, b], set(), "the switch lifted on B lifted on A")
    status, _ = await call("DELETE", a, "/killswitch?scope=global")
    assert status == 404


async def test_a_sidecar_started_after_the_set_sees_it(
    tmp_path: Path, redis: RedisServer, procs: list[SidecarProcess]
) -> None:
    a = await start(procs, tmp_path, redis, "pod-a")
    route = {"scope": "route:orders", "ttl": "1h", "reason": "slow"}
    assert (await call("PUT", a, "/killswitch", route))[0] == 200
    c = await start(procs, tmp_path, redis, "pod-c")
    await seen([c], {"route:orders"}, "the switch on the sidecar started later")


async def test_a_switch_flipped_while_a_third_sidecar_starts_converges_on_all(
    tmp_path: Path, redis: RedisServer, procs: list[SidecarProcess]
) -> None:
    a = await start(procs, tmp_path, redis, "pod-a")
    b = await start(procs, tmp_path, redis, "pod-b")
    starting = asyncio.create_task(start(procs, tmp_path, redis, "pod-c"))
    flips = 0
    while not starting.done():  # set and lift, over and over, while C starts
        flips += 1
        method, path = (
            ("PUT", "/killswitch") if flips % 2 else ("DELETE", "/killswitch?scope=global")
        )
        status, _ = await call(method, a, path, GLOBAL if method == "PUT" else None)
        assert status in (200, 404)
    c = await starting
    assert (await call("PUT", b, "/killswitch", GLOBAL))[0] == 200
    await seen([a, b, c], {"global"}, "the last set on all three")
    assert (await call("DELETE", c, "/killswitch?scope=global"))[0] == 200
    await seen([a, b, c], set(), "the last lift on all three")


async def test_redis_killed_keeps_the_switches_and_says_so_then_converges(
    tmp_path: Path, redis: RedisServer, procs: list[SidecarProcess]
) -> None:
    a = await start(procs, tmp_path, redis, "pod-a")
    b = await start(procs, tmp_path, redis, "pod-b")
    assert (await call("PUT", a, "/killswitch", GLOBAL))[0] == 200
    await seen([a, b], {"global"}, "the switch on both")
    assert await fleet_gauge(b) == "1"
    redis.kill()

    async def disconnected() -> bool:
        return await fleet_gauge(a) == "0" and await fleet_gauge(b) == "0"

    await until_async(disconnected, "fleet_connected 0 on both", timeout=BOUND)
    assert await scopes(a) == {"global"} and await scopes(b) == {"global"}  # kept

    # The cause, in the client's own words, beside "unreachable" (GET /status and the page);
    # the first failure may be the old connection closed, the next ones are refused.
    async def refused() -> bool:
        status, body = await call("GET", b, "/status")
        assert status == 200
        fleet = body["process"]["fleet"]["killswitch"]
        return fleet["state"] == "unreachable" and "Error 111 connecting to" in str(fleet["error"])

    await until_async(refused, "the refused connection named on GET /status", timeout=BOUND)
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{b}/") as r:
        page = await r.text()
    assert 'id="fleet-killswitch">unreachable' in page and "Error 111 connecting to" in page
    assert "the switches last known are kept" in page
    status, body = await call("DELETE", b, "/killswitch?scope=global")
    assert status == 503 and "nothing changed" in body["error"]
    status, body = await call("PUT", b, "/killswitch", {**GLOBAL, "scope": "route:orders"})
    assert status == 503 and "unreachable" in body["error"]
    redis.start()  # the AOF brings the hash back

    async def connected() -> bool:
        return await fleet_gauge(a) == "1" and await fleet_gauge(b) == "1"

    await until_async(connected, "fleet_connected 1 on both", timeout=BOUND)
    assert (await call("GET", b, "/status"))[1]["process"]["fleet"] == {
        "killswitch": {
            "state": "connected",
            "error": None,
            "while_unreachable": "the switches last known are kept; setting or lifting one is "
            "refused",
        }
    }
    assert (await call("DELETE", b, "/killswitch?scope=global"))[0] == 200
    await seen([a, b], set(), "the lift after the restart on both")


async def test_the_task_cancelled_half_way_closes_its_connections(redis: RedisServer) -> None:
    from redis.asyncio import Redis

    from sidecar.config.fleet import Fleet, FleetRedis
    from sidecar.core import Clock
    from sidecar.fleet.links import FleetLinks
    from sidecar.fleet.switches import FleetSwitches

    links = FleetLinks()
    made = FleetSwitches.of(Fleet(FleetRedis(url=redis.url), killswitch=True), Clock(), links)
    assert made is not None
    fleet: FleetSwitches = made
    observer = Redis.from_url(redis.url)

    async def ours() -> int:
        listed = await observer.client_list()
        return sum(1 for c in listed if c.get("name") == "retry-sidecar")

    try:
        task = asyncio.create_task(fleet.run())
        # Subscribed and waiting for a message (one connection reads, one listens).
        await until_async(lambda: _subscribed(observer, fleet.channel), "the subscription")
        assert await ours() >= 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until_async(lambda: _none(ours), "every connection of the task closed")
        assert links.states() == []  # its link closed, it is no longer shown
    finally:
        await observer.aclose()


async def _subscribed(observer: Any, channel: str) -> bool:
    counts = await observer.pubsub_numsub(channel)
    return bool(counts and counts[0][1] == 1)


async def _none(ours: Any) -> bool:
    return bool(await ours() == 0)

"""Every use of the fleet's Redis shows its state, from outside: a real sidecar process with
one use on (the idempotency keys, or the DLQ) in front of a real redis-server that is paused
(SIGSTOP) past ``fleet.redis.timeout``: ``retry_sidecar_fleet_connected{use=...}`` 0,
``GET /status`` ``process.fleet`` unreachable with the error's text, the status page's row and
``retry-sidecar status`` say so, the log warns naming the use; resumed, the next call brings it
back to 1 and the log says so. Only the uses that are on have a series."""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from html import escape
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.admin.test_status_cli import cli
from tests.conftest import reply
from tests.proc import SidecarProcess, start_process
from tests.redisserver import RedisServer
from tests.wait import until_async

pytestmark = pytest.mark.slow
BOUND = 15.0  # seconds: a paused Redis noticed (a 250 ms timeout), or answering again
TIMEOUT_TEXT = "did not answer in time"
# Per use: its config, and one request that makes one call of that use's link.
USES = {
    "idempotency": (
        "idempotency: {{backend: redis}}\nroutes:\n  - name: orders\n"
        '    upstream: "{up}"\n    retry: {{attempts: 1}}\n    idempotency: {{enabled: true}}\n',
        "POST",
    ),
    "dlq": (
        "dlq: {{backend: redis}}\nroutes:\n  - name: orders\n"
        '    upstream: "{up}"\n    retry: {{attempts: 1}}\n    dlq: {{enabled: true}}\n',
        "PUT",
    ),
}


def fleet(redis: RedisServer) -> str:
    return f'fleet: {{redis: {{url: "{redis.url}", timeout: 250ms}}}}\n'


async def get(admin: int, path: str) -> str:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{admin}{path}") as r:
        assert r.status == 200
        return await r.text()


async def gauges(admin: int) -> dict[str, str]:
    """``retry_sidecar_fleet_connected`` by use: every series there is."""
    text = await get(admin, "/metrics")
    found = re.findall(r'^retry_sidecar_fleet_connected\{use="([^"]+)"\} (\S+)$', text, re.M)
    series = [x for x in text.splitlines() if x.startswith("retry_sidecar_fleet_connected")]
    assert len(series) == len(found), series  # no series without a use
    return dict(found)


async def status(admin: int, session: aiohttp.ClientSession) -> dict[str, Any]:
    async with session.get(f"http://127.0.0.1:{admin}/status") as r:
        body: dict[str, Any] = await r.json()
    fleet: dict[str, Any] = body["process"]["fleet"]
    return fleet


@pytest.mark.parametrize("use", list(USES))
async def test_a_paused_redis_shows_its_use_unreachable_then_connected_again(
    use: str,
    tmp_path: Path,
    redis: RedisServer,
    procs: list[SidecarProcess],
    upstream_factory: Any,
) -> None:
    config, method = USES[use]
    up = await upstream_factory(reply(503))  # a write the DLQ takes; a key released
    proc, port, admin = await start_process(tmp_path, fleet(redis) + config.format(up=up.url))
    procs.append(proc)
    sent = 0

    async def one_call(session: aiohttp.ClientSession) -> None:
        nonlocal sent
        sent += 1
        url = f"http://127.0.0.1:{port}/orders"
        headers = {"Idempotency-Key": f"k{sent}"}
        async with session.request(method, url, data=b"x", headers=headers) as r:
            await r.read()

    async with aiohttp.ClientSession() as s:
        await one_call(s)
        assert await gauges(admin) == {use: "1"}  # this use only: the others are off
        redis.pause()
        try:

            async def unreachable() -> bool:
                await one_call(s)
                return (await gauges(admin)).get(use) == "0"

            await until_async(unreachable, f"fleet_connected{{use={use}}} 0", timeout=BOUND)
            shown = await status(admin, s)
            assert list(shown) == [use]
            assert (shown[use]["state"], shown[use]["error"]) == ("unreachable", TIMEOUT_TEXT)
            page = await get(admin, "/")
            assert f'id="fleet-{use}">unreachable' in page
            assert escape(f"{TIMEOUT_TEXT}; {shown[use]['while_unreachable']}") in page
            told = await cli("status", "--admin", f"http://127.0.0.1:{admin}")
            assert f"fleet redis: {use} unreachable ({TIMEOUT_TEXT};" in told.stdout, told
        finally:
            redis.resume()

        async def connected() -> bool:
            await one_call(s)
            return (await gauges(admin)).get(use) == "1"

        await until_async(connected, f"fleet_connected{{use={use}}} 1 again", timeout=BOUND)
        shown = await status(admin, s)
        assert (shown[use]["state"], shown[use]["error"]) == ("connected", None)
        assert f'id="fleet-{use}">connected' in await get(admin, "/")
    log = proc.stderr()
    assert f"the fleet Redis ({use}) failed: {TIMEOUT_TEXT}" in log
    assert f"the fleet Redis ({use}) answers again" in log


async def test_every_use_that_is_on_has_its_series_and_its_row(
    tmp_path: Path, redis: RedisServer, procs: list[SidecarProcess], upstream_factory: Any
) -> None:
    up = await upstream_factory(reply(200))
    body = (
        f'fleet: {{redis: {{url: "{redis.url}", timeout: 250ms}}, killswitch: true}}\n'
        "idempotency: {backend: redis}\ndlq: {backend: redis}\nroutes:\n  - name: orders\n"
        f'    upstream: "{up.url}"\n    idempotency: {{enabled: true}}\n    dlq: {{enabled: true}}\n'
    )
    proc, _, admin = await start_process(tmp_path, body)
    procs.append(proc)
    every = {"dlq": "1", "idempotency": "1", "killswitch": "1"}
    assert await gauges(admin) == every
    async with aiohttp.ClientSession() as s:
        assert {u: f["state"] for u, f in (await status(admin, s)).items()} == {
            u: "connected" for u in every
        }
    page = await get(admin, "/")
    assert all(f'id="fleet-{u}">connected' in page for u in every)


def pings(redis: RedisServer) -> int:
    """How many PINGs this Redis has answered (``INFO commandstats``)."""
    import redis as redispy

    with redispy.Redis(port=redis.port) as r:
        stats: dict[str, Any] = r.info("commandstats")
    return int(stats.get("cmdstat_ping", {}).get("calls", 0))


async def guarded_write_while_paused(port: int, redis: RedisServer) -> None:
    """One guarded write to a paused Redis: its claim times out, the link is unreachable."""
    redis.pause()
    async with (
        aiohttp.ClientSession() as s,
        s.post(
            f"http://127.0.0.1:{port}/orders", data=b"x", headers={"Idempotency-Key": "blip"}
        ) as r,
    ):
        await r.read()


async def test_a_quiet_link_comes_back_by_itself_once_redis_answers(
    tmp_path: Path, redis: RedisServer, procs: list[SidecarProcess], upstream_factory: Any
) -> None:
    """Outside finding (issue 29): after a 3 s pause with one guarded write in it, and no
    traffic after, ``fleet_connected{use="idempotency"}`` stayed 0 (and the critical alert
    would fire) while Redis was healthy. The app's ``fleet-probe`` PINGs a link shown
    unreachable; a connected one is not probed."""
    up = await upstream_factory(reply(200))
    config, _ = USES["idempotency"]
    proc, port, admin = await start_process(tmp_path, fleet(redis) + config.format(up=up.url))
    procs.append(proc)
    try:
        await guarded_write_while_paused(port, redis)
        assert (await gauges(admin))["idempotency"] == "0"
        await asyncio.sleep(3)  # the pause of the finding, probes failing meanwhile
    finally:
        redis.resume()

    async def connected() -> bool:  # no request to the proxy: only the probe can bring it back
        return (await gauges(admin))["idempotency"] == "1"

    await until_async(connected, 'fleet_connected{use="idempotency"} 1', timeout=BOUND)
    async with aiohttp.ClientSession() as s:
        shown = await status(admin, s)
    assert (shown["idempotency"]["state"], shown["idempotency"]["error"]) == ("connected", None)
    assert "the fleet Redis (idempotency) answers again" in proc.stderr()
    before = pings(redis)
    await asyncio.sleep(2)  # four probe rounds: a connected link is not asked
    assert pings(redis) == before


def queued_at(port: int) -> int:
    """Connections to ``port`` whose sent bytes the server has not read (its Recv-Q)."""
    out = subprocess.run(
        ["ss", "-Htn", "state", "established", f"( sport = :{port} )"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(1 for line in out.splitlines() if int(line.split()[0]) > 0)


async def test_a_stop_while_a_probe_waits_on_a_paused_redis_is_prompt(
    tmp_path: Path, redis: RedisServer, procs: list[SidecarProcess], upstream_factory: Any
) -> None:
    """The probe task cancelled half-way: a PING in flight to a paused Redis (a 5 s timeout),
    and SIGTERM: the sidecar stops without waiting out the PING."""
    up = await upstream_factory(reply(200))
    config, _ = USES["idempotency"]
    slow = f'fleet: {{redis: {{url: "{redis.url}", timeout: 5s}}}}\n'
    proc, _, admin = await start_process(tmp_path, slow + config.format(up=up.url))
    procs.append(proc)
    try:
        redis.pause()  # a support engineer's look (5 s), then the link is unreachable; no
        # guarded write: a key it left held would be settled at stop, against the pause
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{admin}/idempotency/k") as r,
        ):
            assert r.status == 503, await r.text()
        assert (await gauges(admin))["idempotency"] == "0"
        stuck = queued_at(redis.port)
        deadline = time.monotonic() + BOUND

        while queued_at(redis.port) <= stuck:  # the probe's PING sent, not answered
            assert time.monotonic() < deadline, "no probe reached the paused Redis"
            await asyncio.sleep(0.05)
        started = time.monotonic()
        code = proc.terminate()
        took = time.monotonic() - started
    finally:
        redis.resume()
    assert code == 0
    print(f"stopped in {took:.2f}s with the probe's PING in flight")
    assert took < 4.0, f"the stop waited {took:.1f}s on the probe's PING (timeout 5 s)"

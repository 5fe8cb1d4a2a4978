"""Every use of the fleet's Redis shows its state, from outside: a real sidecar process with
one use on (the idempotency keys, or the DLQ) in front of a real redis-server that is paused
(SIGSTOP) past ``fleet.redis.timeout``: ``retry_sidecar_fleet_connected{use=...}`` 0,
``GET /status`` ``process.fleet`` unreachable with the error's text, the status page's row and
``retry-sidecar status`` say so, the log warns naming the use; resumed, the next call brings it
back to 1 and the log says so. Only the uses that are on have a series."""

from __future__ import annotations

import re
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

"""The idempotency link's connections are opened at start, not mid-burst: the real sidecar
process has them open before its first request; ``FleetLink.open_connections`` cancelled at any
point gives every connection it took back to the pool. Against a real redis-server."""

from __future__ import annotations

import asyncio
import random

import pytest
from redis.asyncio import Redis

from sidecar.fleet.connection import CALLS_MAX, FleetLink
from sidecar.testing import FakeClock
from tests.fleet.test_connection_redis import link_to
from tests.idempotency import test_idempotency_store as contract
from tests.idempotency.test_idempotency_store import Run
from tests.proc import SidecarProcess, start_process
from tests.redisserver import RedisServer
from tests.wait import until_async

run = contract.run  # the fixture: each test under asyncio and uvloop


async def sidecar_clients(redis: RedisServer) -> int:
    client = Redis.from_url(redis.url)
    try:
        listed = await client.client_list()
    finally:
        await client.aclose()
    return sum(1 for c in listed if c.get("name") == "retry-sidecar")


@pytest.mark.slow
async def test_the_idempotency_store_opens_its_connections_at_start(
    redis: RedisServer, tmp_path, procs: list[SidecarProcess]
) -> None:
    """Before any request, the store's link holds its pool open: a burst of guarded writes
    finds its connections made (opened mid-burst, handing one out took 150-316 ms)."""
    proc, _, _ = await start_process(
        tmp_path,
        "idempotency: {backend: redis}\n"
        f'fleet: {{redis: {{url: "{redis.url}"}}}}\n'
        "routes:\n"
        "  - name: orders\n"
        '    upstream: "http://127.0.0.1:9"\n'
        "    idempotency: {enabled: true}\n",
    )
    procs.append(proc)

    async def opened() -> bool:
        return await sidecar_clients(redis) >= CALLS_MAX

    await until_async(opened, f"{CALLS_MAX} connections of the sidecar's open at Redis")


def _in_use(link: FleetLink) -> int:
    return len(link.client.connection_pool._in_use_connections)


def test_open_connections_cancelled_half_way_gives_every_connection_back(
    run: Run, redis: RedisServer
) -> None:
    rng = random.Random(5)

    async def main() -> None:
        for _ in range(6):
            link = link_to(redis.url, FakeClock())
            try:
                opening = asyncio.ensure_future(link.open_connections())
                await asyncio.sleep(rng.uniform(0.0, 0.01))
                opening.cancel()
                await asyncio.gather(opening, return_exceptions=True)
                assert _in_use(link) == 0
                assert await link.call(lambda r: r.ping()) is True
                assert _in_use(link) == 0
            finally:
                await link.close()
        link = link_to(redis.url, FakeClock())
        try:
            assert await link.open_connections() == CALLS_MAX
            assert _in_use(link) == 0
        finally:
            await link.close()

    run(main)

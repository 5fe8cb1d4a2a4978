"""Issue 29 item 7: at start the sidecar reads the fleet Redis's ``maxmemory-policy`` and
``maxmemory`` (``fleet.eviction``) for each use that keeps data there, and warns when keys may be
evicted, saying what an eviction means; against real redis-servers started with the settings
(tests/redisserver.py), the warning read from ``GET /status``, the page and the log."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.fleet.eviction import EVICTED, judge
from tests.conftest import reply
from tests.redisserver import running
from tests.wait import until

EVICTING = ("--maxmemory", "10mb", "--maxmemory-policy", "allkeys-lru")


@pytest.mark.parametrize(
    ("settings", "warned"),
    [
        ({"maxmemory-policy": "noeviction", "maxmemory": "10485760"}, False),
        ({"maxmemory-policy": "noeviction", "maxmemory": "0"}, False),
        ({"maxmemory-policy": "allkeys-lru", "maxmemory": "10485760"}, True),
        ({"maxmemory-policy": "volatile-ttl", "maxmemory": "10485760"}, True),
        ({"maxmemory-policy": "allkeys-random", "maxmemory": "0"}, True),
        ({}, True),  # nothing said: unknown
    ],
)
@pytest.mark.parametrize("use", sorted(EVICTED))
def test_judge(settings: dict[str, str], warned: bool, use: str) -> None:
    said = judge(settings, use)
    assert (said is not None) == warned
    if said is not None:
        assert EVICTED[use] in said and "noeviction" in said


def config(up: str, redis: str) -> str:
    return f"""
version: 1
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0"}}
fleet:
  redis: {{url: "{redis}", timeout: 2s}}
idempotency: {{backend: redis}}
dlq: {{backend: redis}}
defaults:
  retry: {{attempts: 1}}
  idempotency: {{enabled: true}}
  dlq: {{enabled: true}}
routes:
  - name: main
    upstream: "{up}"
"""


async def status(client: aiohttp.ClientSession, sc: Any) -> tuple[dict[str, Any], str]:
    base = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    async with client.get(base + "/status") as resp:
        process: dict[str, Any] = (await resp.json())["process"]
    async with client.get(base + "/") as resp:
        page = await resp.text()
    return process, page


async def test_a_redis_that_may_evict_is_warned_of_for_keys_and_dlq(
    tmp_path: Path, upstream_factory: Any, sidecar_factory: Any, client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    caplog.set_level(logging.WARNING)
    up = await upstream_factory(reply(201))
    with running(tmp_path / "redis", *EVICTING) as redis:
        sc = await sidecar_factory(config(up.url, redis.url))
        await until(
            lambda: sc.sidecar.keys.warning is not None and sc.sidecar.dlqs.warning is not None,
            "the start-up checks",
        )
        process, page = await status(client, sc)
        keys, dlq = process["idempotency_warning"], process["dlq_warning"]
        assert "maxmemory-policy allkeys-lru (maxmemory 10485760)" in keys
        assert EVICTED["idempotency"] in keys and "duplicate run the write again" in keys
        assert "maxmemory-policy allkeys-lru" in dlq and "a DLQ record evicted is lost" in dlq
        assert 'id="idempotency-warning"' in page and "allkeys-lru" in page
        assert any("idempotency keys on Redis" in r.getMessage() for r in caplog.records)
        # A warning, not a refusal: guarded writes go through.
        async with client.post(sc.url + "/x", headers={"Idempotency-Key": "k1"}) as resp:
            assert resp.status == 201


async def test_noeviction_is_not_warned_of(
    tmp_path: Path, upstream_factory: Any, sidecar_factory: Any, client: aiohttp.ClientSession
) -> None:
    up = await upstream_factory(reply(201))
    args = ("--maxmemory", "10mb", "--maxmemory-policy", "noeviction")
    with running(tmp_path / "redis", *args) as redis:
        sc = await sidecar_factory(config(up.url, redis.url))
        async with client.post(sc.url + "/x", headers={"Idempotency-Key": "k1"}) as resp:
            assert resp.status == 201  # the store answered: the check ran (or runs) meanwhile
        tasks = sc.sidecar._tasks  # spawned at start, dropped from it once done
        checks = ("idempotency-redis-check", "dlq-redis-check")
        await until(lambda: not any(name in tasks for name in checks), "the start-up checks")
        process, page = await status(client, sc)
        assert process["idempotency_warning"] is None and process["dlq_warning"] is None
        assert "idempotency-warning" not in page


async def test_a_redis_refusing_config_is_unknown_not_fatal(
    tmp_path: Path, upstream_factory: Any, sidecar_factory: Any, client: aiohttp.ClientSession
) -> None:
    up = await upstream_factory(reply(201))
    with running(tmp_path / "redis", "--rename-command", "CONFIG", '""') as redis:
        sc = await sidecar_factory(config(up.url, redis.url))
        await until(lambda: sc.sidecar.keys.warning is not None, "the start-up check")
        process, _ = await status(client, sc)
        assert "cannot check the fleet Redis's maxmemory-policy" in process["idempotency_warning"]
        assert "unknown" in process["idempotency_warning"]
        async with client.post(sc.url + "/x", headers={"Idempotency-Key": "k1"}) as resp:
            assert resp.status == 201

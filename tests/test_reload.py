"""Hot reload: file edits (in place, atomic rename, ConfigMap symlink swap), the admin endpoint,
invalid edits, and what survives a reload."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

from aiohttp import web

from tests.conftest import reply, routes_yaml

RELOAD_WITHIN = 2.0


async def attempts_seen(client, url: str) -> int:
    async with client.get(url + "/x") as resp:
        await resp.read()
        return int(resp.headers["x-retry-attempts"])


async def eventually_attempts(client, url: str, want: int) -> float:
    started = time.monotonic()
    while time.monotonic() - started < RELOAD_WITHIN:
        if await attempts_seen(client, url) == want:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    raise AssertionError(f"policy with {want} attempts not in force within {RELOAD_WITHIN}s")


def policy(up_url: str, attempts: int) -> str:
    # The breaker stays out of the way: these tests poll a failing upstream many times.
    return routes_yaml(
        up_url,
        f"    retry: {{attempts: {attempts}}}\n    breaker: {{min_sequences: 100000}}\n"
        "    throttle: {enabled: false}",
    )


async def start_with_file(sidecar_factory, path: Path, text: str):
    path.write_text(text)
    return await sidecar_factory(text, config_path=str(path))


async def test_in_place_edit(upstream_factory, sidecar_factory, client, tmp_path):
    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 1))
    assert await attempts_seen(client, sc.url) == 1
    with open(cfg, "w") as f:  # same inode
        f.write(policy(up.url, 3))
    await eventually_attempts(client, sc.url, 3)


async def test_atomic_rename(upstream_factory, sidecar_factory, client, tmp_path):
    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 1))
    tmp = tmp_path / ".sidecar.yaml.tmp"
    tmp.write_text(policy(up.url, 2))
    os.replace(tmp, cfg)
    await eventually_attempts(client, sc.url, 2)


async def test_configmap_symlink_swap(upstream_factory, sidecar_factory, client, tmp_path):
    """The layout the kubelet writes for a ConfigMap volume, and its atomic ..data swap."""
    up = await upstream_factory(reply(503))
    v1 = tmp_path / "..2026_11_25_01"
    v1.mkdir()
    (v1 / "sidecar.yaml").write_text(policy(up.url, 1))
    (tmp_path / "..data").symlink_to(v1.name)
    (tmp_path / "sidecar.yaml").symlink_to("..data/sidecar.yaml")
    cfg = tmp_path / "sidecar.yaml"
    sc = await sidecar_factory(cfg.read_text(), config_path=str(cfg))
    assert await attempts_seen(client, sc.url) == 1

    v2 = tmp_path / "..2026_11_25_02"
    v2.mkdir()
    (v2 / "sidecar.yaml").write_text(policy(up.url, 3))
    (tmp_path / "..data_tmp").symlink_to(v2.name)
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    await eventually_attempts(client, sc.url, 3)


async def test_invalid_edit_changes_nothing_that_serves(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 2))
    version = sc.sidecar.store.current.sha256
    cfg.write_text(policy(up.url, 99))
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    started = time.monotonic()
    while sc.sidecar.store.last_error is None and time.monotonic() - started < RELOAD_WITHIN:
        await asyncio.sleep(0.05)
    async with client.get(admin + "/config") as resp:
        body = await resp.json()
    assert body["version"] == version
    assert "routes[0].retry.attempts" in body["last_error"]
    async with client.get(admin + "/metrics") as resp:
        assert "retry_sidecar_config_last_reload_successful 0" in await resp.text()
    assert await attempts_seen(client, sc.url) == 2
    # The admin endpoint says the same, with 422 and the errors.
    async with client.post(admin + "/config/reload") as resp:
        assert resp.status == 422
        err = await resp.json()
        assert any("routes[0].retry.attempts" in e for e in err["errors"])
    # Fixing the file recovers.
    cfg.write_text(policy(up.url, 3))
    async with client.post(admin + "/config/reload") as resp:
        assert resp.status == 200
        ok = await resp.json()
        assert ok["changed"] and ok["version"] != version
    assert await attempts_seen(client, sc.url) == 3
    async with client.get(admin + "/metrics") as resp:
        assert "retry_sidecar_config_last_reload_successful 1" in await resp.text()


async def test_listen_change_is_reported_not_applied(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(200))
    cfg = tmp_path / "sidecar.yaml"
    text = policy(up.url, 2)
    sc = await start_with_file(sidecar_factory, cfg, text)
    cfg.write_text(text.replace('listen: "127.0.0.1:0"', 'listen: "127.0.0.1:15999"', 1))
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    async with client.post(admin + "/config/reload") as resp:
        body = await resp.json()
    assert resp.status == 200
    assert any(
        r.startswith("listen: 127.0.0.1:0 -> 127.0.0.1:15999") for r in body["restart_required"]
    )
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200  # still serving where it was


async def test_in_flight_requests_keep_their_snapshot(
    upstream_factory, sidecar_factory, client, tmp_path
):
    async def slow_503(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(0.5)
        return web.Response(status=503)

    up = await upstream_factory(slow_503, reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 3))
    task = asyncio.create_task(attempts_seen(client, sc.url))
    await asyncio.sleep(0.1)
    cfg.write_text(policy(up.url, 1))
    assert (await sc.sidecar.reload("test")).changed  # type: ignore[union-attr]
    assert await task == 3  # started under attempts: 3
    assert await attempts_seen(client, sc.url) == 1


async def test_kill_switch_and_breaker_survive_a_reload(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 3))
    sc.sidecar.kill.set("route:main", 60, "incident", "test", time.monotonic(), time.time())
    cfg.write_text(policy(up.url, 4))
    await sc.sidecar.reload("test")
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "kill-switch"
    assert sc.sidecar.store.current.routes[0].retry.attempts == 4

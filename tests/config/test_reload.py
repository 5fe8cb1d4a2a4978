"""Hot reload: file edits (in place, atomic rename, ConfigMap symlink swap), the admin endpoint,
invalid edits, and what survives a reload."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.conftest import hang, reply, routes_yaml
from tests.proc import start_process
from tests.wait import BOUND, until, until_async

# A bound on the wait for a reload, not a latency promise: the watcher polls every 0.5 s and
# compares hashes every 5 s (an in-place edit in the same mtime tick as its last look is
# only seen then), and CI runs on a loaded machine.
RELOAD_WITHIN = BOUND


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
async def test_invalid_edit_changes_nothing_that_serves(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 2))
    version = sc.sidecar.store.current.sha256
    cfg.write_text(policy(up.url, 99))
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    await until(lambda: sc.sidecar.store.last_error is not None, "the bad edit to be seen")
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


async def test_a_bad_edit_put_back_clears_the_failed_reload(upstream_factory, tmp_path):
    """Outside finding (issue 29): a bad file written by rename, then the good file renamed
    back, left the gauge at 0 and ``last_error`` set until SIGHUP, and the reload alert fired
    while the file and the process agreed. The real process, its watcher at 0.5 s."""
    up = await upstream_factory(reply(200))
    body = f'routes:\n  - name: r\n    upstream: "{up.url}"\n    retry: {{attempts: 2}}\n'
    proc, _port, admin = await start_process(tmp_path, body)
    cfg = proc.config_path
    good = cfg.read_text()
    url = f"http://127.0.0.1:{admin}"

    def put(text: str) -> None:
        tmp = tmp_path / ".sidecar.yaml.tmp"
        tmp.write_text(text)
        os.replace(tmp, cfg)

    async def state(s: aiohttp.ClientSession) -> tuple[str, str | None, str]:
        async with s.get(url + "/config") as resp:
            body = await resp.json()
        async with s.get(url + "/metrics") as resp:
            gauge = next(
                line.split()[1]
                for line in (await resp.text()).splitlines()
                if line.startswith("retry_sidecar_config_last_reload_successful ")
            )
        return gauge, body["last_error"], body["version"]

    try:
        async with aiohttp.ClientSession() as s:
            version = (await state(s))[2]
            put(good.replace("attempts: 2", "attempts: 99"))  # invalid: at most 10

            async def failed() -> bool:
                return (await state(s))[0] == "0"

            await until_async(failed, "the bad edit to be refused")
            error = (await state(s))[1]
            assert error is not None and "attempts" in error
            put(good)

            async def cleared() -> bool:
                return (await state(s))[:2] == ("1", None)

            await until_async(cleared, "the put-back file to clear the failure")
            assert (await state(s))[2] == version
            await asyncio.sleep(1.5)  # three more polls: the line is not repeated
    finally:
        proc.terminate()
    assert proc.stderr().count("the file is back to the config in force") == 1


def test_every_config_key_is_live_or_restart_only():
    """A reload applies a key or reports it; a key added to the model without saying which is
    a reload silently ignoring it."""
    import dataclasses
    import typing

    from sidecar.config.model import Config
    from sidecar.config.watch import RELOAD_RULES

    def unclassified(cls: type, prefix: str) -> list[str]:
        out = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if key in RELOAD_RULES or key in ("source", "sha256", "warnings"):
                continue
            sub = hints[f.name]
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                out += unclassified(sub, key + ".")  # classified key by key
            else:
                out.append(key)
        return out

    assert unclassified(Config, "") == []
    assert set(RELOAD_RULES.values()) == {"live", "restart"}


async def test_restart_only_keys_are_reported_not_applied(
    upstream_factory, sidecar_factory, client, tmp_path, caplog
):
    up = await upstream_factory(reply(200))
    cfg = tmp_path / "sidecar.yaml"
    text = policy(up.url, 2)
    sc = await start_with_file(sidecar_factory, cfg, text)
    changed = (
        text.replace('listen: "127.0.0.1:0"', 'listen: "127.0.0.1:15999"', 1).replace(
            'admin: {listen: "127.0.0.1:0"}',
            'admin: {listen: "127.0.0.1:15998", token_env: OTHER_TOKEN}',
        )
        + "upstream_pool: {max_connections: 7}\n"
        + "limits: {keepalive_timeout: 5s}\n"
        + f'dlq: {{path: "{tmp_path / "elsewhere.sqlite3"}"}}\n'
    )
    cfg.write_text(changed)
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    async with client.post(admin + "/config/reload") as resp:
        assert resp.status == 200
        body = await resp.json()
    want = [
        "listen",
        "admin.listen",
        "admin.token_env",
        "dlq.path",
        "limits.keepalive_timeout",
        "upstream_pool.max_connections",
    ]
    assert body["restart_required"] == want
    async with client.get(admin + "/config") as resp:
        assert (await resp.json())["restart_required"] == want
    warned = [r.getMessage() for r in caplog.records if "needs a restart" in r.getMessage()]
    assert any("listen: 127.0.0.1:0 -> 127.0.0.1:15999" in m for m in warned)
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200  # still serving where it was
    cfg.write_text(text)  # back to what the process runs with: nothing pending
    async with client.post(admin + "/config/reload") as resp:
        assert (await resp.json())["restart_required"] == []
    # upstream_pool.dns_refresh applies at once (docs/configuration.md): a reload changing only it is not
    # reported as needing a restart (the whole section was compared, and it was).
    cfg.write_text(text + "upstream_pool: {dns_refresh: 1s}\n")
    async with client.post(admin + "/config/reload") as resp:
        assert (await resp.json())["restart_required"] == []
    assert sc.sidecar.store.current.upstream_pool.dns_refresh == 1.0


async def test_dlq_bounds_apply_on_reload(upstream_factory, sidecar_factory, client, tmp_path):
    from tests.dlq.test_dlq import dlq_yaml

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    cfg = tmp_path / "sidecar.yaml"

    def text(n: int) -> str:
        return dlq_yaml(up.url, db).replace(
            f'dlq: {{path: "{db}"}}', f'dlq: {{path: "{db}", max_records: {n}}}'
        )

    sc = await start_with_file(sidecar_factory, cfg, text(1))
    seen = []
    for _ in range(2):
        async with client.put(sc.url + "/o", data=b"1") as resp:
            seen.append(resp.headers["x-retry-dlq"])
    assert seen == ["stored", "full"]
    cfg.write_text(text(3))
    result = await sc.sidecar.reload("test")
    assert result is not None and result.ok and result.restart_required == []
    for _ in range(3):
        async with client.put(sc.url + "/o", data=b"1") as resp:
            seen.append(resp.headers["x-retry-dlq"])
    assert seen[2:] == ["stored", "stored", "full"]
    cfg.write_text(text(100).replace("max_records: 100}", "max_records: 100, max_bytes: 10}"))
    await sc.sidecar.reload("test")
    async with client.put(sc.url + "/o", data=b"1") as resp:
        assert resp.headers["x-retry-dlq"] == "full"  # nothing stored is dropped
    assert sc.sidecar.dlq is not None and sc.sidecar.dlq.counts.by_status["pending"] == 3


async def test_a_reload_that_enables_the_dlq_opens_it(
    upstream_factory, sidecar_factory, client, tmp_path
):
    from tests.dlq.test_dlq import dlq_yaml

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    cfg = tmp_path / "sidecar.yaml"
    enabled = dlq_yaml(up.url, db)
    sc = await start_with_file(
        sidecar_factory, cfg, enabled.replace("dlq: {enabled: true}", "dlq: {enabled: false}")
    )
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    async with client.get(admin + "/dlq") as resp:
        assert resp.status == 503
    cfg.write_text(enabled)
    result = await sc.sidecar.reload("test")
    assert result is not None and result.restart_required == []
    await until(lambda: sc.sidecar.dlq is not None, "the DLQ to open")
    async with client.put(sc.url + "/o", data=b"1") as resp:
        assert resp.headers["x-retry-dlq"] == "stored"
    async with client.get(admin + "/dlq") as resp:
        assert len((await resp.json())["records"]) == 1
    assert {"dlq-redrive", "dlq-prune"} <= set(sc.sidecar.task_names())


async def test_shutting_down_while_a_reload_opens_the_dlq_leaves_no_writer(
    upstream_factory, client, tmp_path
):
    """The DLQ is opened in a worker thread; a shutdown that cancels the opening must close
    whatever that thread opens afterwards (no writer thread, no open file left behind)."""
    import sqlite3
    import threading

    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text
    from tests.dlq.test_dlq import dlq_yaml

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    cfg = tmp_path / "sidecar.yaml"
    enabled = dlq_yaml(up.url, db)
    disabled = enabled.replace("dlq: {enabled: true}", "dlq: {enabled: false}")
    cfg.write_text(disabled)
    sc = Sidecar(parse_text(disabled, str(cfg)), config_path=str(cfg))
    sc.dlqs.busy_timeout_ms = 20_000
    # When the opening thread starts and when it has returned what it opened: the moments to
    # wait for, rather than guessed sleeps.
    entered: list[bool] = []
    returned: list[bool] = []
    real_open = sc.dlqs.open_sqlite

    def open_and_tell(config):
        entered.append(True)
        try:
            return real_open(config)
        finally:
            returned.append(True)

    sc.dlqs.open_sqlite = open_and_tell  # type: ignore[method-assign]
    await sc.start()
    blocker = sqlite3.connect(db, isolation_level=None)  # the file appears after the start
    blocker.execute("PRAGMA journal_mode=WAL")
    blocker.execute("BEGIN IMMEDIATE")  # the opening thread waits on this lock
    try:
        cfg.write_text(enabled)
        await sc.reload("test")
        assert "dlq-open" in sc.task_names()
        await until(lambda: entered, "the opening thread to start")  # it waits on the lock
        await sc.stop()
        assert not returned
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    # The thread finishes opening (starting a writer); what it opened is closed again, by the
    # thread itself: the event loop is not run meanwhile (a stopped process's loop is gone, so
    # a close left to a callback on it would leave the writer thread running).
    import time

    for _ in range(3000):  # bounded: 30 s
        if returned and not any(t.name == "dlq-writer" for t in threading.enumerate()):
            break
        time.sleep(0.01)
    assert returned, "the opening thread to return"
    assert not any(t.name == "dlq-writer" for t in threading.enumerate()), "writer left running"
    assert sc.dlq is None


async def test_drain_timeout_applies_on_reload(upstream_factory, client, tmp_path):
    """The drain started after a reload uses the reloaded drain_timeout."""
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    up = await upstream_factory(hang(30))
    cfg = tmp_path / "sidecar.yaml"
    text = (
        routes_yaml(up.url, "    timeout: 60s\n    retry: {attempts: 1, per_try_timeout: 60s}")
        + "drain_timeout: 30s\n"
    )
    cfg.write_text(text)
    sc = Sidecar(parse_text(text, str(cfg)), config_path=str(cfg))
    await sc.start()
    stopped = False
    try:
        cfg.write_text(text.replace("drain_timeout: 30s", "drain_timeout: 200ms"))
        result = await sc.reload("test")
        assert result is not None and result.restart_required == []
        pending = asyncio.create_task(client.get(f"http://127.0.0.1:{sc.proxy_port}/x"))
        while not up.seen:
            await asyncio.sleep(0.02)
        # 30 s (the old value) against 0.2 s (the reloaded one): a bound in between.
        async with asyncio.timeout(10):
            await sc.stop()
        stopped = True
        with contextlib.suppress(aiohttp.ClientError):
            (await pending).release()
    finally:
        if not stopped:
            await sc.stop()


@pytest.mark.slow
async def test_a_good_file_written_during_a_failed_reload_is_loaded(
    upstream_factory, sidecar_factory, client, tmp_path, monkeypatch
):
    """The watcher must remember as bad the bytes it parsed, not the file as it is after the
    parse: an editor's next (good) save may land in between."""
    from sidecar.config import parse as parse_mod
    from sidecar.config.errors import ConfigError

    up = await upstream_factory(reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 1))
    real = parse_mod.parse_text
    fixed = False

    def parse_then_fix(text: str, source: str = "<memory>"):
        nonlocal fixed
        try:
            return real(text, source)
        except ConfigError:
            if not fixed:
                fixed = True
                cfg.write_text(policy(up.url, 3))  # the good save lands just after the parse
            raise

    monkeypatch.setattr(parse_mod, "parse_text", parse_then_fix)
    cfg.write_text(policy(up.url, 99))  # invalid: attempts is at most 10
    await eventually_attempts(client, sc.url, 3)
    assert fixed


async def test_in_flight_requests_keep_their_snapshot(
    upstream_factory, sidecar_factory, client, tmp_path
):
    release = asyncio.Event()

    async def held_503(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(status=503)

    up = await upstream_factory(held_503, reply(503))
    cfg = tmp_path / "sidecar.yaml"
    sc = await start_with_file(sidecar_factory, cfg, policy(up.url, 3))
    task = asyncio.create_task(attempts_seen(client, sc.url))
    await until(lambda: len(up.seen) == 1, "the first attempt to reach the upstream")
    cfg.write_text(policy(up.url, 1))
    assert (await sc.sidecar.reload("test")).changed  # type: ignore[union-attr]
    release.set()
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


async def test_a_reload_that_shrinks_the_bulkhead_applies_to_what_is_in_flight(
    upstream_factory, sidecar_factory, client, tmp_path
):
    """Four requests in flight, the bulkhead reloaded from 4 to 1: a fifth is refused (503
    overloaded) until they are done, as Envoy applies a lowered limit to the current count.
    Before, the reload started a fresh semaphore and let the fifth in at once."""
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text="done")

    up = await upstream_factory(held)
    cfg = tmp_path / "sidecar.yaml"

    def text(n: int) -> str:
        return routes_yaml(
            up.url,
            "    retry: {attempts: 1, per_try_timeout: 30s}\n"
            f"    bulkhead: {{max_concurrent: {n}, queue_timeout: 100ms, adaptive: false}}",
        )

    sc = await start_with_file(sidecar_factory, cfg, text(4))
    bulkhead = sc.sidecar.states.get("main").bulkhead

    async def get() -> tuple[int, str | None]:
        async with client.get(sc.url + "/x") as resp:
            await resp.read()
            return resp.status, resp.headers.get("x-retry-proxy-error")

    four = [asyncio.create_task(get()) for _ in range(4)]
    for _ in range(250):
        if bulkhead.in_flight == 4:
            break
        await asyncio.sleep(0.02)
    assert bulkhead.in_flight == 4
    cfg.write_text(text(1))
    result = await sc.sidecar.reload("test")
    assert result is not None and result.ok
    assert await get() == (503, "overloaded")
    release.set()
    assert [s for s, _ in await asyncio.gather(*four)] == [200] * 4
    assert await get() == (200, None)

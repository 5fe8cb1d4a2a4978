"""Applying a config is all or nothing: a value validate accepts never fails the apply, and a
failure while applying rolls back to the config (and file switches) that were live, reported
like a file that does not parse."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.conftest import reply, routes_yaml
from tests.proc import start_process

BAD_UNTILS = ("9999-12-31T23:59:59-05:00", "0001-01-01T00:00:00+23:59")


async def test_an_until_the_process_cannot_represent_is_refused_by_validate_and_reload(
    upstream_factory, tmp_path: Path
) -> None:
    """Outside finding: ``until: 9999-12-31T23:59:59-05:00`` (the year 10000 in UTC) passed
    validate; the reload answered 500 with the new routes and switches live, /killswitch and
    the status page answered 500 from then on, and every restart exited 1."""
    up = await upstream_factory(reply(200))
    routes = f'routes:\n  - name: main\n    upstream: "{up.url}"\n'
    proc, port, admin = await start_process(tmp_path, routes)
    cfg = proc.config_path
    good = cfg.read_text()
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(f"http://127.0.0.1:{admin}/config") as resp:
                version = (await resp.json())["version"]
            for until in BAD_UNTILS:
                entry = f"  - {{scope: global, reason: INC-1, until: {until}}}\n"
                bad = (
                    good
                    + f'  - name: new\n    match: {{path_prefix: /new}}\n    upstream: "{up.url}"\n'
                    + "killswitches:\n"
                    + entry
                )
                cfg.write_text(bad)
                line = bad.splitlines().index(entry.rstrip("\n")) + 1
                res = subprocess.run(
                    [sys.executable, "-m", "sidecar", "validate", str(cfg)],
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                assert res.returncode == 1, res.stdout + res.stderr
                assert f"{cfg}:{line}: killswitches[0].until: " in res.stdout + res.stderr

                async with s.post(f"http://127.0.0.1:{admin}/config/reload") as resp:
                    assert resp.status == 422, await resp.text()
                    [err] = (await resp.json())["errors"]
                assert err.startswith(f"{cfg}:{line}: killswitches[0].until: "), err
                async with s.get(f"http://127.0.0.1:{admin}/config") as resp:
                    body = await resp.json()
                assert body["version"] == version and "killswitches[0].until" in body["last_error"]
                # The old config and its (no) switches serve; the admin API answers.
                async with s.get(f"http://127.0.0.1:{port}/new") as resp:
                    assert resp.headers["x-retry-fate"] == "success"  # "main" took it
                    assert len(up.seen) and up.seen[-1].raw_path == "/new"
                async with s.get(f"http://127.0.0.1:{admin}/killswitch") as resp:
                    assert resp.status == 200 and (await resp.json())["switches"] == []
                for page in ("/", "/status"):
                    async with s.get(f"http://127.0.0.1:{admin}{page}") as resp:
                        assert resp.status == 200, page
    finally:
        proc.terminate()
    # A restart with the bad file refuses to start with the line, not a traceback.
    again = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert again.returncode == 1
    assert "killswitches[0].until" in again.stderr and "Traceback" not in again.stderr


def rollback_policy(up_url: str, new_url: str, extra: str = "") -> str:
    """``main`` (503s, two attempts) and, with ``extra``, the edit that fails to apply."""
    text = routes_yaml(
        up_url,
        "    retry: {attempts: 2}\n    breaker: {min_sequences: 100000}",
        admin='admin: {listen: "127.0.0.1:0"}',
    )
    if not extra:
        return text
    return (
        text.replace(
            "routes:\n",
            f'routes:\n  - name: new\n    match: {{path: /new}}\n    upstream: "{new_url}"\n',
        )
        .replace("retry: {attempts: 2}", "retry: {attempts: 3}")
        .replace("min_sequences: 100000", "min_sequences: 99999")
        + extra
    )


class _StatesThatFailOnce:
    """The sidecar's route states, whose next ``sync`` fails once after it has run whole (the
    kept route got its new breaker policy, the new route its state). A wrapper on the
    interpreted ``Sidecar`` rather than a patch of ``engine.routestate``: compiled with mypyc
    (CI's second pass), that module binds its globals and a patched name would never be
    called."""

    def __init__(self, real: Any) -> None:
        self._real = real
        self._failed = False

    def sync(self, config: Any) -> None:
        self._real.sync(config)
        if not self._failed:
            self._failed = True
            raise ValueError("year 10000 is out of range")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _fail_once_applied(monkeypatch: pytest.MonkeyPatch, where: str, side: Any) -> None:
    """A fault while applying: ``late`` when the audit line of the new file switches is
    written (the first finding's own failure: the instant could not be shown), after the
    store swapped and the switches were replaced; ``early`` right after the route states
    were synced to the new config (the first step of applying it)."""
    from sidecar.admin import killswitch

    def fail(*args: object, **kwargs: object) -> object:
        raise ValueError("year 10000 is out of range")

    if where == "late":
        monkeypatch.setattr(killswitch, "iso", fail)
    else:
        monkeypatch.setattr(side, "states", _StatesThatFailOnce(side.states))


@pytest.mark.parametrize("where", ["late", "early"])
async def test_a_failure_while_applying_rolls_back_and_is_reported_like_a_bad_file(
    upstream_factory, sidecar_factory, client, tmp_path: Path, monkeypatch, caplog, where
) -> None:
    """The reload answered 500 with no log line while the new routes and switches were
    live and last_error was null. Now: 422, the old config, route policies and (no) file
    switches live, last_error set, the reload metric 0, a log line; and once the fault is
    gone the same file loads."""
    caplog.set_level(logging.ERROR)
    up = await upstream_factory(reply(503))
    other = await upstream_factory(reply(200))
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(rollback_policy(up.url, other.url))
    sc = await sidecar_factory(cfg.read_text(), config_path=str(cfg))
    side = sc.sidecar
    admin = f"http://127.0.0.1:{side.admin_port}"
    version, loaded = side.store.current.sha256, side.store.loaded
    breaker = side.states.get("main").breaker.policy
    switch = '  - {scope: global, reason: "INC-9", until: "2099-01-01T00:00:00Z"}\n'
    cfg.write_text(rollback_policy(up.url, other.url, "killswitches:\n" + switch))
    _fail_once_applied(monkeypatch, where, side)

    async with client.post(admin + "/config/reload") as resp:
        assert resp.status == 422, await resp.text()
        [err] = (await resp.json())["errors"]
    assert err.startswith(f"{cfg}:0: <file>: applying it failed: ValueError"), err
    assert side.store.current.sha256 == version and side.store.loaded == loaded
    assert side.store.last_error == err
    assert side.states.get("main").breaker.policy == breaker
    assert side.kill.active(side.clock.monotonic()) == []
    assert any("applying the config failed" in r.getMessage() for r in caplog.records)
    async with client.get(admin + "/metrics") as resp:
        assert "retry_sidecar_config_last_reload_successful 0" in await resp.text()
    async with client.get(admin + "/config") as resp:
        assert (await resp.json())["last_error"] == err
    async with client.get(sc.url + "/new") as resp:  # the old routes, policy, no switch
        assert resp.status == 503 and resp.headers["x-retry-attempts"] == "2"
    assert other.seen == []

    monkeypatch.undo()  # the fault gone, the same file loads whole
    async with client.post(admin + "/config/reload") as resp:
        assert resp.status == 200, await resp.text()
    async with client.get(sc.url + "/new") as resp:
        assert resp.status == 200 and len(other.seen) == 1
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "kill-switch"
    assert side.store.last_error is None

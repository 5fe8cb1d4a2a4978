"""Applying a config is all or nothing: a value validate accepts never fails the apply, and a
failure while applying rolls back to the config (and file switches) that were live, reported
like a file that does not parse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp

from tests.conftest import reply
from tests.test_contract import start_process

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

"""retry-sidecar status and killswitch list|set|lift against the real running process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp

from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port

TOKEN = "cli-test-token-42"


async def cli(*args: str, token: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TEST_ADMIN_TOKEN"}
    if token:
        env["TEST_ADMIN_TOKEN"] = token
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sidecar", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )


async def test_status_and_killswitch_verbs(upstream_factory, tmp_path):
    up = await upstream_factory(reply(503), reply(200))
    port, admin = free_port(), free_port()
    text = routes_yaml(
        up.url,
        top_extra='killswitches:\n  - {scope: global, reason: "from the file", '
        'until: "2099-01-01T00:00:00Z"}',
        admin=f'admin: {{listen: "127.0.0.1:{admin}", token_env: TEST_ADMIN_TOKEN}}',
    ).replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    proc = SidecarProcess(cfg, env={"TEST_ADMIN_TOKEN": TOKEN})
    proc.start()
    try:
        await proc.wait_port(port, admin)
        async with aiohttp.ClientSession() as s:
            for _ in range(4):
                async with s.get(f"http://127.0.0.1:{port}/x") as r:
                    await r.read()

        st = await cli("status", "--config", str(cfg))
        assert st.returncode == 0, st.stderr
        lines = st.stdout.splitlines()
        assert lines[0].startswith("test-edge  ready  up ")
        header = lines[2].split()
        assert header[:4] == ["ROUTE", "REQ/S", "SUCCESS", "RETRIES/REQ"]
        row = lines[3].split()
        assert row[0] == "main" and "file" in lines[3]
        assert "kill-switch" in lines[3]  # the fates column: the file switch cut the retries
        assert any(line.startswith("global") and "from the file" in line for line in lines)

        as_json = json.loads((await cli("status", "--json", "--config", str(cfg))).stdout)
        assert as_json["routes"][0]["requests"] == 4

        listed = await cli("killswitch", "list", "--admin", f"http://127.0.0.1:{admin}")
        assert listed.returncode == 0 and "global" in listed.stdout and "file" in listed.stdout

        # Writes need the token: without it, a clear error and exit 1.
        denied = await cli(
            "killswitch", "set", "route:main", "--ttl", "15m", "--reason", "x", "--config", str(cfg)
        )
        assert denied.returncode == 1 and "401" in denied.stderr
        done = await cli(
            "killswitch",
            "set",
            "route:main",
            "--ttl",
            "15m",
            "--reason",
            "INC-12 retries amplify",
            "--config",
            str(cfg),
            token=TOKEN,
        )
        assert done.returncode == 0 and done.stdout.startswith("retries off for route:main until ")
        listed = json.loads(
            (await cli("killswitch", "list", "--json", "--config", str(cfg))).stdout
        )
        assert {(s["scope"], s["source"]) for s in listed["switches"]} == {
            ("global", "file"),
            ("route:main", "admin"),
        }
        lifted = await cli("killswitch", "lift", "route:main", "--config", str(cfg), token=TOKEN)
        assert lifted.returncode == 0 and lifted.stdout == "lifted route:main\n"
        from_file = await cli("killswitch", "lift", "global", "--config", str(cfg), token=TOKEN)
        assert from_file.returncode == 1 and "policy file" in from_file.stderr
        bad = await cli(
            "killswitch", "set", "route:nope", "--ttl", "1m", "--reason", "x",
            "--config", str(cfg), token=TOKEN,
        )  # fmt: skip
        assert bad.returncode == 1 and "scope" in bad.stderr
    finally:
        assert proc.terminate() == 0

    gone = await cli("status", "--admin", f"http://127.0.0.1:{admin}")
    assert gone.returncode == 1 and "cannot reach the admin API" in gone.stderr

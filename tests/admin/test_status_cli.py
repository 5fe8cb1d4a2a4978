"""retry-sidecar status and killswitch list|set|lift against the real running process."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import pytest

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


@pytest.mark.slow
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


HOSTILE = "INC-9\x1b]0;pwned\x07\x1b[2J\r\u009b31m\u202eevil\x7f"


def test_printable_escapes_what_a_terminal_would_obey():
    from sidecar.admin.fmt import printable

    shown = printable(HOSTILE + " ü 😀 tab\there")
    assert shown == (
        "INC-9\\x1b]0;pwned\\x07\\x1b[2J\\x0d\\x9b31m\\u202eevil\\x7f ü 😀 tab\\x09here"
    )


async def test_a_hostile_kill_switch_reason_is_printed_escaped(upstream_factory, tmp_path):
    """Finding 20: ``killswitch list`` and ``status`` printed a reason's control characters
    raw (clear screen, retitle the terminal: kubectl's CVE-2021-25743 class)."""
    up = await upstream_factory(reply(200))
    port, admin = free_port(), free_port()
    text = routes_yaml(up.url, admin=f'admin: {{listen: "127.0.0.1:{admin}"}}').replace(
        'listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1
    )
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    proc = SidecarProcess(cfg)
    proc.start()
    try:
        await proc.wait_port(port, admin)
        async with aiohttp.ClientSession() as s:
            body = {"scope": "route:main", "ttl": "5m", "reason": HOSTILE}
            async with s.put(f"http://127.0.0.1:{admin}/killswitch", json=body) as r:
                assert r.status == 200
        outputs = []
        for verb in (
            ("killswitch", "list"),
            ("killswitch", "list", "--json"),
            ("status",),
            ("status", "--json"),
        ):
            done = await cli(*verb, "--config", str(cfg))
            assert done.returncode == 0, done.stderr
            outputs.append(done.stdout)
        set_ = await cli(
            "killswitch", "set", "global", "--ttl", "1m", "--reason", HOSTILE, "--config", str(cfg)
        )
        assert set_.returncode == 0, set_.stderr
        outputs.append(set_.stdout)
        for out in outputs:
            bad = {c for c in out if (ord(c) < 32 and c != "\n") or 0x7F <= ord(c) <= 0x9F}
            assert bad == set() and "\u202e" not in out, out
        assert "INC-9\\x1b]0;pwned" in outputs[0]  # shown, escaped, not dropped
        assert json.loads(outputs[1])["switches"][0]["reason"] == HOSTILE  # still exact JSON
    finally:
        assert proc.terminate() == 0


# Verbs whose endpoint needs the token, one per path through the CLI's client.
GATED = [
    ("killswitch", "set", "route:main", "--ttl", "15m", "--reason", "x"),
    ("killswitch", "lift", "route:main"),
    ("idempotency", "show", "k1"),
    ("idempotency", "forget", "k1"),
    ("dlq", "purge", "1"),
    ("dlq", "replay", "1"),
]


@pytest.mark.slow
async def test_a_401_names_the_variable_to_set(upstream_factory, tmp_path):
    """Outside finding (issue 29): the CLI's 401 said only 401. It names the variable to set:
    the one ``admin.token_env`` names (read from --config), else RETRY_SIDECAR_ADMIN_TOKEN
    (--admin URL alone), and says whether a token was sent and refused."""
    up = await upstream_factory(reply(200))
    port, admin = free_port(), free_port()
    text = routes_yaml(
        up.url, admin=f'admin: {{listen: "127.0.0.1:{admin}", token_env: TEST_ADMIN_TOKEN}}'
    ).replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    proc = SidecarProcess(cfg, env={"TEST_ADMIN_TOKEN": TOKEN})
    proc.start()
    try:
        await proc.wait_port(port, admin)
        for verb in GATED:
            out = await cli(*verb, "--config", str(cfg))
            assert out.returncode == 1 and "error: 401: " in out.stderr, (verb, out.stderr)
            assert "(no token sent: set TEST_ADMIN_TOKEN to this sidecar's admin token)" in (
                out.stderr
            ), (verb, out.stderr)
            out = await cli(*verb, "--config", str(cfg), token="wrong")
            assert "(the token in TEST_ADMIN_TOKEN was refused: set TEST_ADMIN_TOKEN" in (
                out.stderr
            ), (verb, out.stderr)
            out = await cli(*verb, "--admin", f"http://127.0.0.1:{admin}")
            assert "set RETRY_SIDECAR_ADMIN_TOKEN to" in out.stderr, (verb, out.stderr)
        assert "wrong" not in out.stderr
    finally:
        proc.terminate()

"""retry-sidecar dlq list|show|replay|purge against the real running process."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp

from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sidecar", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_dlq_verbs(upstream_factory, tmp_path):
    up = await upstream_factory(reply(503))
    port, admin = free_port(), free_port()
    db = tmp_path / "dlq.sqlite3"
    text = routes_yaml(
        up.url,
        "    dlq: {enabled: true}",
        top_extra=f'dlq: {{path: "{db}"}}',
        admin=f'admin: {{listen: "127.0.0.1:{admin}"}}',
    ).replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1)
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    proc = SidecarProcess(cfg)
    proc.start()
    try:
        await proc.wait_port(port, admin)
        async with (
            aiohttp.ClientSession() as s,
            s.put(f"http://127.0.0.1:{port}/doc/1", data=b"v1") as r,
        ):
            rid = r.headers["x-retry-dlq-id"]
        listed = await cli("dlq", "list", "--config", str(cfg))
        assert listed.returncode == 0 and rid in listed.stdout and "pending" in listed.stdout
        shown = await cli("dlq", "show", rid, "--config", str(cfg))
        assert shown.returncode == 0 and json.loads(shown.stdout)["body"] == "v1"
        dry = await cli("dlq", "replay", "--dry-run", "--admin", f"http://127.0.0.1:{admin}")
        assert json.loads(dry.stdout)["would_replay"] == [rid]
        up.script = [reply(200)]
        replayed = await cli("dlq", "replay", rid, "--config", str(cfg))
        assert replayed.returncode == 0 and json.loads(replayed.stdout)["status"] == "delivered"
        purged = await cli("dlq", "purge", rid, "--config", str(cfg))
        assert purged.returncode == 0
        again = await cli("dlq", "purge", rid, "--config", str(cfg))
        assert again.returncode == 1 and again.stdout == ""
        assert again.stderr.startswith("error: 404: no DLQ record")  # as the other verbs

        # Paging: the hint printed under a page is an option that exists and works.
        up.script = [reply(503)]
        ids = []
        async with aiohttp.ClientSession() as s:
            for i in range(3):
                async with s.put(f"http://127.0.0.1:{port}/doc/{i}", data=b"v") as r:
                    ids.append(r.headers["x-retry-dlq-id"])
        first = await cli("dlq", "list", "--limit", "2", "--order", "oldest", "--config", str(cfg))
        assert first.returncode == 0 and ids[0] in first.stdout and ids[2] not in first.stdout
        hint = first.stdout.strip().splitlines()[-1]
        assert "--cursor " in hint
        cursor = hint.split("--cursor ", 1)[1].rstrip(")")
        second = await cli(
            "dlq", "list", "--limit", "2", "--order", "oldest", "--cursor", cursor,
            "--config", str(cfg),
        )  # fmt: skip
        assert second.returncode == 0, second.stderr
        assert ids[2] in second.stdout and ids[0] not in second.stdout
        assert "--cursor" not in second.stdout  # the last page
    finally:
        assert proc.terminate() == 0

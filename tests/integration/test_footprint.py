"""What the real ``retry-sidecar`` process loads: the DLQ stack (sqlite3 and its library) only
once a DLQ is in use, so a sidecar with no DLQ route does not carry it in its memory."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from tests.conftest import reply
from tests.dlq.test_dlq import dlq_yaml, rows
from tests.proc import SidecarProcess, free_port


def sqlite_mapped(pid: int) -> bool:
    """Whether the process has sqlite's code mapped (the ``_sqlite3`` extension or
    libsqlite3), read from /proc: what the process really loaded, not what it says."""
    with open(f"/proc/{pid}/maps") as f:
        return any("sqlite3" in line.rsplit("/", 1)[-1] for line in f if "/" in line)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux /proc")
async def test_sqlite_is_loaded_only_when_a_reload_enables_a_dlq_route(upstream_factory, tmp_path):
    up = await upstream_factory(reply(503))  # every write fails: a DLQ route captures it
    port, admin_port = free_port(), free_port()
    db = tmp_path / "dlq.sqlite3"
    enabled = (
        dlq_yaml(up.url, db)
        .replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1)
        .replace('admin: {listen: "127.0.0.1:0"}', f'admin: {{listen: "127.0.0.1:{admin_port}"}}')
    )
    disabled = enabled.replace("dlq: {enabled: true}", "dlq: {enabled: false}")
    assert disabled != enabled
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(disabled)
    proc = SidecarProcess(cfg)
    proc.start()
    assert proc.proc is not None
    pid = proc.proc.pid
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        await proc.wait_port(port, admin_port)
        async with aiohttp.ClientSession() as s:
            # Serving, writes included, and the DLQ endpoints: still no sqlite.
            async with s.put(f"http://127.0.0.1:{port}/o", data=b"1") as resp:
                assert resp.status == 503
                assert "x-retry-dlq" not in resp.headers
            async with s.get(admin + "/dlq") as resp:
                assert resp.status == 503  # no DLQ open
            assert not sqlite_mapped(pid)
            assert not db.exists()

            cfg.write_text(enabled)
            async with s.post(admin + "/config/reload") as resp:
                assert resp.status == 200, await resp.text()
            for _ in range(200):  # the DLQ opens in the background after the reload
                async with s.get(admin + "/dlq") as resp:
                    if resp.status == 200:
                        break
                await asyncio.sleep(0.05)
            async with s.put(f"http://127.0.0.1:{port}/o", data=b"2") as resp:
                assert resp.headers["x-retry-dlq"] == "stored"
            # The same check now sees sqlite: it could have failed above.
            assert sqlite_mapped(pid)
    finally:
        rc = proc.terminate()
    assert rc == 0, proc.stderr()
    stored = rows(db)
    assert len(stored) == 1 and stored[0][1] == "pending" and stored[0][4] == b"2"

"""The DLQ's redrive and replays under a kill switch, a drain and a reload, against the real
process: a switch that forbids sending is never what lets a replay through, and nothing
acknowledged is lost or sent twice."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from aiohttp import web

from tests.proc import SidecarProcess, free_port
from tests.wait import until


def redrive_yaml(up_url: str, db: Path, port: int, admin_port: int, breaker: str) -> str:
    return f"""
version: 1
name: switches
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin_port}"}}
dlq: {{path: "{db}"}}
defaults:
  retry: {{attempts: 1}}
  breaker: {breaker}
  dlq: {{enabled: true, max_replays: 5, replay_rate: 50, redrive: {{enabled: true, interval: 1s}}}}
routes:
  - name: main
    upstream: "{up_url}"
"""


async def test_a_kill_switch_never_lets_the_redrive_past_an_open_breaker(
    upstream_factory, tmp_path
):
    """The breaker is open for a minute, so the redrive sends nothing. A kill switch makes a
    sequence skip the breaker: it used to let every replay through at once (60 in a second,
    each spending one of max_replays). Now the redrive pauses while a switch covers its route,
    and a replay by hand sends nothing either (fate kill-switch, the record untouched)."""
    replays: list[str] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("x-retry-replay")
        if rid is None:
            return web.Response(status=503)
        replays.append(rid)
        return web.Response(status=200)

    up = await upstream_factory(upstream)
    db = tmp_path / "dlq.sqlite3"
    port, admin_port = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(redrive_yaml(up.url, db, port, admin_port, "{min_sequences: 2, open_for: 60s}"))
    proc = SidecarProcess(cfg)
    proc.start()
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        await proc.wait_port(port, admin_port)
        async with aiohttp.ClientSession() as s:
            ids = []
            for i in range(12):
                async with s.post(
                    f"http://127.0.0.1:{port}/o/{i}",
                    data=b"v",
                    headers={"Idempotency-Key": f"k{i}"},
                ) as r:
                    assert r.headers["x-retry-dlq"] == "stored"
                    ids.append(r.headers["x-retry-dlq-id"])
            assert r.headers["x-retry-fate"] == "breaker-open"
            switch = {"scope": "route:main", "ttl": "15m", "reason": "INC-1"}
            async with s.put(admin + "/killswitch", json=switch) as r:
                assert r.status == 200, await r.text()
            # The redrive looks at the route every second: it either pauses (and says so) or
            # sends past the open breaker.
            await until(
                lambda: "redrive of route main paused" in proc.stderr() or replays,
                "the redrive to pause, or to send",
            )
            assert replays == []
            async with s.post(admin + f"/dlq/{ids[0]}/replay") as r:
                out = await r.json()
            assert out["fate"] == "kill-switch" and out["status"] == "pending"
            assert out["http_status"] is None
            async with s.get(admin + f"/dlq/{ids[0]}") as r:
                assert (await r.json())["replays"] == 0
            assert replays == []
    finally:
        assert proc.terminate() == 0

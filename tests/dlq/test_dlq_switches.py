"""The DLQ's redrive and replays under a kill switch, a drain and a reload, against the real
process: a switch that forbids sending is never what lets a replay through, and nothing
acknowledged is lost or sent twice."""

from __future__ import annotations

import asyncio
import random
import signal
import sqlite3
from pathlib import Path

import aiohttp
import pytest
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
    and a replay by hand is not sent past the open breaker either (the record untouched)."""
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
            # By hand: sent as live traffic is under the switch, but never past a breaker
            # that is not closed.
            async with s.post(admin + f"/dlq/{ids[0]}/replay") as r:
                out = await r.json()
            assert out["fate"] == "breaker-open" and out["status"] == "pending"
            assert out["http_status"] is None
            async with s.get(admin + f"/dlq/{ids[0]}") as r:
                assert (await r.json())["replays"] == 0
            assert replays == []
    finally:
        assert proc.terminate() == 0


# -- a switch, a drain or a reload at a random moment of a live redrive -----------------------

RECORDS = 30
EVENTS = ("kill-switch", "drain", "reload")


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("event", EVENTS)
async def test_a_switch_drain_or_reload_mid_redrive_stops_it_and_loses_nothing(
    upstream_factory, tmp_path, event, seed
):
    """A redrive replays 30 records at 20 a second; at a random moment of it a kill switch
    is set, the sidecar is drained (SIGTERM) or a reload turns the redrive off. From then on
    no replay starts: at most the one already on its way arrives (one attempt per replay,
    one replay at a time). Then the switch is lifted / the sidecar restarted / the redrive
    turned on again, and every acknowledged record is delivered exactly once: none lost (a
    replay cut half-way would stay pending), none doubled (an answered replay not recorded
    would be sent again)."""
    rng = random.Random(seed)
    arrivals: list[str] = []

    async def upstream(request: web.Request) -> web.StreamResponse:
        rid = request.headers.get("x-retry-replay")
        if rid is None:
            return web.Response(status=503)
        arrivals.append(rid)
        await asyncio.sleep(0.05)  # the event lands while this replay waits for its answer
        return web.Response(status=200)

    up = await upstream_factory(upstream)
    db = tmp_path / "dlq.sqlite3"
    port, admin_port = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    on = redrive_yaml(up.url, db, port, admin_port, "{min_sequences: 100000}").replace(
        "replay_rate: 50", "replay_rate: 20"
    )
    off = on.replace("redrive: {enabled: true, interval: 1s}", "redrive: {enabled: false}")
    assert off != on
    cfg.write_text(off)  # the records are stored first, then the redrive goes on
    proc = SidecarProcess(cfg)
    proc.start()
    admin = f"http://127.0.0.1:{admin_port}"
    try:
        await proc.wait_port(port, admin_port)
        async with aiohttp.ClientSession() as s:
            ids = []
            for i in range(RECORDS):
                async with s.put(f"http://127.0.0.1:{port}/o/{i}", data=b"%d" % i) as r:
                    assert r.headers["x-retry-dlq"] == "stored"
                    ids.append(r.headers["x-retry-dlq-id"])
            cfg.write_text(on)
            async with s.post(admin + "/config/reload") as r:
                assert r.status == 200, await r.text()
            await until(lambda: arrivals, "the redrive to start")
            target = 1 + rng.randrange(RECORDS // 2)
            await until(lambda: len(arrivals) >= target, f"{target} replays")
            if event == "kill-switch":
                switch = {"scope": "route:main", "ttl": "15m", "reason": "mid-redrive"}
                async with s.put(admin + "/killswitch", json=switch) as r:
                    assert r.status == 200, await r.text()
            elif event == "reload":
                cfg.write_text(off)
                async with s.post(admin + "/config/reload") as r:
                    assert r.status == 200, await r.text()
            else:
                assert proc.proc is not None
                proc.proc.send_signal(signal.SIGTERM)
            at_event = len(arrivals)
            if event == "drain":
                # Not proc.terminate(): it blocks this loop, which serves the upstream too.
                running = proc.proc
                assert running is not None
                await until(lambda: running.poll() is not None, "the drained sidecar to exit")
                assert running.returncode == 0
            else:
                # Long enough for the redrive to have gone on if it were going to: it asks
                # before every record, 20 a second, and ticks every second.
                await until(
                    lambda: (
                        event != "kill-switch"
                        or "paused" in proc.stderr()
                        or len(arrivals) > at_event + 1
                    ),
                    "the redrive to pause, or to go on",
                )
                await asyncio.sleep(1.5)
            assert len(arrivals) - at_event <= 1, (event, at_event, len(arrivals))
            stopped_at = len(arrivals)
            if event == "kill-switch":
                async with s.delete(admin + "/killswitch?scope=route:main") as r:
                    assert r.status == 200
            elif event == "reload":
                cfg.write_text(on)
                async with s.post(admin + "/config/reload") as r:
                    assert r.status == 200
            else:
                proc = SidecarProcess(cfg)
                proc.start()
                await proc.wait_port(port, admin_port)
            await until(lambda: statuses(db) == {"delivered"}, "every record delivered", 30)
            assert stopped_at < RECORDS or event != "drain"
    finally:
        assert proc.terminate() == 0
    assert sorted(arrivals) == sorted(ids)  # each exactly once


def statuses(db: Path) -> set[str]:
    conn = sqlite3.connect(db)
    try:
        return {r[0] for r in conn.execute("SELECT status FROM records")}
    finally:
        conn.close()

"""The status page and GET /status: the figures checked against what the sidecar really does,
the HTML's promises (no JavaScript, refresh, headers, no token), and the forms' authentication."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.admin.formauth import NONCE_TTL, FormRefused, Nonces
from sidecar.admin.rates import RateSampler
from sidecar.telemetry.metrics import Metrics
from sidecar.testing import FakeClock
from tests.conftest import hang, reply, routes_yaml

TOKEN = "page-test-token-0123456789"


def admin(sc) -> str:
    return f"http://127.0.0.1:{sc.sidecar.admin_port}"


async def status(client, sc, window: str = "1m") -> dict[str, Any]:
    async with client.get(admin(sc) + "/status", params={"window": window}) as resp:
        assert resp.status == 200
        body: dict[str, Any] = await resp.json()
        return body


def route(st: dict[str, Any], name: str = "main") -> dict[str, Any]:
    return next(r for r in st["routes"] if r["name"] == name)


# -- pure parts -------------------------------------------------------------------------------


def test_rate_windows_come_from_counter_differences():
    clock = FakeClock(monotonic=0.0)
    m = Metrics()
    sampler = RateSampler(m, clock, interval=2.0, keep=40.0)  # 22 samples kept

    def seq(fate: str, n: int = 1) -> None:
        m.requests.inc((("route", "a"), ("fate", fate)), n)

    seq("success", 10)  # before any tick: inside a window that starts at the first sample
    for _ in range(30):  # one minute of samples, 4 requests and 1 retry per 2 s
        clock.advance(2.0)
        seq("success", 3)
        seq("exhausted")
        m.retries.inc((("route", "a"),))
        sampler.tick()
    w = sampler.window(10.0)
    assert w.seconds == 10.0
    assert w.routes["a"].requests == 20 and w.routes["a"].retries == 5
    assert w.routes["a"].fates == {"success": 15, "exhausted": 5}
    whole = sampler.window(600.0)  # longer than the history: as far back as it goes
    assert whole.seconds == 42.0  # 31 samples taken, the oldest of the last 22 is at t=18
    assert whole.routes["a"].requests == 21 * 4
    fresh = RateSampler(m, clock)  # right after start: the window is the time since start
    clock.advance(1.0)
    assert fresh.window(60.0).seconds == 1.0 and fresh.window(60.0).routes["a"].requests == 0


def test_nonces_are_one_time_signed_and_expire():
    n = Nonces()
    a = n.issue("/ui/killswitch", 1000.0)
    n.use("/ui/killswitch", a, 1001.0)
    with pytest.raises(FormRefused) as again:
        n.use("/ui/killswitch", a, 1002.0)
    assert again.value.status == 409
    forged = (
        "",
        "x",
        a[:-1] + ("0" if a[-1] != "0" else "1"),
        Nonces().issue("/ui/killswitch", 1000.0),
    )
    for bad in forged:
        with pytest.raises(FormRefused) as refused:
            n.use("/ui/killswitch", bad, 1001.0)
        assert refused.value.status == 403
    old = n.issue("/ui/killswitch", 1000.0)
    with pytest.raises(FormRefused, match="expired"):
        n.use("/ui/killswitch", old, 1000.0 + NONCE_TTL + 1)


def test_a_nonce_is_good_for_its_own_form_only():
    """Finding 21: the nonce of one form (lift) submitted another (set)."""
    n = Nonces()
    lift = n.issue("/ui/killswitch/lift", 1000.0)
    for other in ("/ui/killswitch", "/ui/dlq/replay"):
        with pytest.raises(FormRefused) as refused:
            n.use(other, lift, 1001.0)
        assert refused.value.status == 403
    n.use("/ui/killswitch/lift", lift, 1001.0)  # refused elsewhere, not used up


# -- the figures, against the sidecar's behaviour ---------------------------------------------


async def test_requests_fates_and_retries_per_request(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503), reply(200), reply(404))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/a") as resp:  # 503 then 200: success after 1 retry
        assert resp.headers["x-retry-fate"] == "success"
    for _ in range(3):  # 404s: not retried
        async with client.get(sc.url + "/b") as resp:
            assert resp.headers["x-retry-fate"] == "not-retryable"
    r = route(await status(client, sc))
    assert r["requests"] == 4 and r["fates"] == {"not-retryable": 3, "success": 1}
    assert r["success_ratio"] == 0.25 and r["retries_per_request"] == 0.25
    assert r["rps"] > 0 and r["breaker"] == "closed" and r["switches"] == []


async def test_budget_left_is_what_the_budget_then_allows(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 2}\n    budget: {ratio: 0, min_per_second: 0.5, window: 10s}\n"
            "    breaker: {min_sequences: 100000}\n    throttle: {enabled: false}",
        )
    )
    for _ in range(2):
        async with client.get(sc.url + "/x") as resp:
            assert resp.headers["x-retry-attempts"] == "2"
    left = route(await status(client, sc))["budget_left"]
    assert left == 3
    fates = []
    for _ in range(left + 1):
        async with client.get(sc.url + "/x") as resp:
            fates.append(resp.headers["x-retry-fate"])
    assert fates == ["exhausted"] * left + ["budget-exhausted"]
    assert route(await status(client, sc))["budget_left"] == 0


async def test_breaker_open_with_the_time_to_its_next_probe(
    upstream_factory, sidecar_factory, client
):
    # On the test's (stopped) clock the refusal's Retry-After and the page's figure are read
    # at the same instant, however slowly the machine runs between the two.
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    retry: {attempts: 1}\n"
            "    breaker: {min_sequences: 2, failure_ratio: 0.5, open_for: 30s}",
        ),
        clock=FakeClock(),
    )
    for _ in range(2):
        async with client.get(sc.url + "/x") as resp:
            await resp.read()
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "breaker-open"
        retry_after = int(resp.headers["Retry-After"])
    r = route(await status(client, sc))
    assert r["breaker"] == "open"
    assert r["next_probe_in"] == 30 and retry_after == 30
    assert (r["breaker_sequences"], r["breaker_failures"]) == (2, 2)


async def test_in_flight_counts_a_hanging_attempt(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(hang(5))
    sc = await sidecar_factory(routes_yaml(up.url, "    retry: {attempts: 1, per_try_timeout: 5s}"))
    task = asyncio.create_task(client.get(sc.url + "/slow"))
    try:
        for _ in range(100):
            r = route(await status(client, sc))
            if r["in_flight"] == 1:
                break
            await asyncio.sleep(0.02)
        assert r["in_flight"] == 1 and r["max_concurrent"] == 1000
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_kill_switches_show_on_every_route_they_cover(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.put(
        admin(sc) + "/killswitch", json={"scope": "global", "ttl": "10m", "reason": "INC-3"}
    ) as resp:
        assert resp.status == 200
    st = await status(client, sc)
    [sw] = route(st)["switches"]
    assert (sw["scope"], sw["source"], sw["reason"]) == ("global", "admin", "INC-3")
    assert 590 < sw["expires_in"] <= 600 and st["switches"] == [sw]


def dlq_policy(up_url: str, db: Path) -> str:
    return routes_yaml(
        up_url,
        "    retry: {attempts: 1}\n    dlq: {enabled: true}\n    breaker: {min_sequences: 100000}",
        top_extra=f'dlq: {{path: "{db}"}}',
    )


async def test_dlq_pending_parked_and_oldest_match_the_dlq_api(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(dlq_policy(up.url, tmp_path / "dlq.sqlite3"))
    ids = []
    for i in range(3):
        async with client.put(sc.url + f"/doc/{i}", data=b"v") as resp:
            ids.append(resp.headers["x-retry-dlq-id"])
        await asyncio.sleep(0.05)
    up.script = [reply(400)]  # a 4xx parks a replayed record
    async with client.post(admin(sc) + f"/dlq/{ids[0]}/replay") as resp:
        assert (await resp.json())["status"] == "parked"
    await asyncio.sleep(1.1)  # past the figures' one-second cache
    before = time.time()
    r = route(await status(client, sc))
    after = time.time()
    async with client.get(admin(sc) + "/dlq", params={"status": "pending"}) as resp:
        pending = (await resp.json())["records"]
    assert (r["dlq_pending"], r["dlq_parked"]) == (len(pending), 1) == (2, 1)
    oldest = min(p["created_at"] for p in pending)
    from datetime import datetime

    # The age is taken at some moment of the status call, from created_at, which the API
    # shows truncated to the millisecond: bracketed exactly, however slow the machine.
    created = datetime.fromisoformat(oldest.replace("Z", "+00:00")).timestamp()
    assert before - created - 0.001 < r["dlq_oldest_pending_age"] <= after - created
    assert r["dlq_oldest_parked_age"] > r["dlq_oldest_pending_age"]  # ids[0] was the first


async def test_a_slow_dlq_read_never_blocks_the_proxy_and_a_dropped_page_leaks_nothing(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(dlq_policy(up.url, tmp_path / "dlq.sqlite3"))
    async with client.put(sc.url + "/doc", data=b"v") as resp:
        assert resp.headers["x-retry-dlq"] == "stored"
    store = sc.sidecar.dlq
    assert store is not None
    store._read_lock.acquire()  # the page's DLQ read now waits in its thread
    try:
        short = aiohttp.ClientTimeout(total=0.5)
        with pytest.raises(asyncio.TimeoutError):
            async with client.get(admin(sc) + "/", timeout=short) as resp:
                await resp.read()
        up.script = [reply(200)]
        async with client.get(sc.url + "/served") as resp:  # the loop is free meanwhile
            assert resp.status == 200
    finally:
        store._read_lock.release()
    async with client.get(admin(sc) + "/?refresh=0") as resp:
        assert resp.status == 200 and "1 pending" in await resp.text()
    assert not store._read_lock.locked()


async def test_every_background_task_is_named_listed_and_cancelled_on_stop(upstream_factory):
    """What /stats lists as background_tasks: each task the sidecar starts is named, listed,
    and cancelled (not left running, not merely finished) when it stops."""
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    up = await upstream_factory(reply(200))
    sc = Sidecar(parse_text(routes_yaml(up.url)))
    await sc.start()
    names = {"status-rates", "heap-trim", "dns-refresh"}
    assert set(sc.task_names()) == names
    tasks = [t for t in asyncio.all_tasks() if t.get_name() in names]
    assert len(tasks) == len(names)
    await sc.stop()
    assert all(t.cancelled() for t in tasks) and sc.task_names() == []


# -- the page ---------------------------------------------------------------------------------


async def test_the_page_is_plain_html_that_refreshes_itself(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    monkeypatch.setenv("TEST_ADMIN_TOKEN", TOKEN)
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url, admin='admin: {listen: "127.0.0.1:0", token_env: TEST_ADMIN_TOKEN}')
    )
    async with client.get(sc.url + "/x") as resp:
        await resp.read()
    async with client.get(admin(sc) + "/") as resp:
        assert resp.status == 200 and resp.content_type == "text/html"
        headers = resp.headers
        text = await resp.text()
    assert '<meta http-equiv="refresh" content="5">' in text
    assert "<script" not in text.lower()  # no JavaScript
    assert not re.search(r"<[^>]+\son[a-z]+=", text)  # no inline event handlers either
    assert "script-src" not in headers["Content-Security-Policy"]  # default-src 'none' rules
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert headers["X-Frame-Options"] == "DENY" and headers["Cache-Control"] == "no-store"
    assert 'id="route-main"' in text and TOKEN not in text
    async with client.get(admin(sc) + "/?refresh=0&window=10s") as resp:
        paused = await resp.text()
    assert "http-equiv" not in paused and "<strong>10s</strong>" in paused
    async with client.get(admin(sc) + "/status", params={"window": "2h"}) as resp:
        assert resp.status == 400


def nonce_of(html: str) -> str:
    m = re.search(r'name="nonce" value="([^"]+)"', html)
    assert m is not None
    return m.group(1)


async def form(client, url: str) -> str:
    async with client.get(url) as resp:
        assert resp.status == 200
        return nonce_of(await resp.text())


async def test_forms_need_the_token_in_the_body_and_a_fresh_nonce(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    monkeypatch.setenv("TEST_ADMIN_TOKEN", TOKEN)
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    breaker: {min_sequences: 100000}",
            admin='admin: {listen: "127.0.0.1:0", token_env: TEST_ADMIN_TOKEN}',
        )
    )
    base = admin(sc)
    fields = {"scope": "route:main", "ttl": "10m", "reason": "INC-8 via the page"}

    async def post(
        extra: dict[str, str], headers: dict[str, str] | None = None
    ) -> tuple[int, str, str | None]:
        data = {**fields, "nonce": await form(client, base + "/ui/killswitch"), **extra}
        async with client.post(
            base + "/ui/killswitch", data=data, headers=headers, allow_redirects=False
        ) as resp:
            return resp.status, await resp.text(), resp.headers.get("Location")

    status_, text, _ = await post({})
    assert status_ == 401 and "token is wrong or missing" in text
    assert 'value="INC-8 via the page"' in text  # filled in again, the token is not
    status_, text, _ = await post({"token": "nope"})
    assert status_ == 401 and "nope" not in text
    status_, _, _ = await post({"token": TOKEN}, {"Origin": "http://evil.example"})
    assert status_ == 403
    status_, text, _ = await post({"token": TOKEN, "ttl": "2d"})
    assert status_ == 400 and "24h" in text
    assert sc.sidecar.kill.active(time.monotonic()) == []  # nothing was set by any of them

    status_, _, location = await post({"token": TOKEN})
    assert status_ == 303 and location is not None and location.startswith("/?done=")
    [sw] = sc.sidecar.kill.active(time.monotonic())
    assert (sw.scope, sw.reason, sw.source, sw.set_by) == (
        "route:main",
        "INC-8 via the page",
        "admin",
        "127.0.0.1",
    )
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "kill-switch"
    async with client.get(base + location) as resp:
        assert "Retries are off for route:main" in await resp.text()

    # The same nonce twice does nothing twice.
    nonce = await form(client, base + "/ui/killswitch/lift?scope=route:main")
    lift = {"scope": "route:main", "nonce": nonce, "token": TOKEN}
    async with client.post(base + "/ui/killswitch/lift", data=lift, allow_redirects=False) as r:
        assert r.status == 303
    async with client.post(base + "/ui/killswitch/lift", data=lift, allow_redirects=False) as r:
        assert r.status == 409
    assert sc.sidecar.kill.active(time.monotonic()) == []

    # The self-checked form paths open nothing else: the JSON API still wants the header.
    async with client.put(base + "/killswitch", json={**fields, "token": TOKEN}) as resp:
        assert resp.status == 401


async def test_replay_parked_records_through_the_form(
    upstream_factory, sidecar_factory, client, tmp_path, monkeypatch
):
    monkeypatch.setenv("TEST_ADMIN_TOKEN", TOKEN)
    up = await upstream_factory(reply(503))
    text = dlq_policy(up.url, tmp_path / "dlq.sqlite3").replace(
        'admin: {listen: "127.0.0.1:0"}',
        'admin: {listen: "127.0.0.1:0", token_env: TEST_ADMIN_TOKEN}',
    )
    sc = await sidecar_factory(text)
    base = admin(sc)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with client.put(sc.url + "/doc", data=b"v") as resp:
        rid = resp.headers["x-retry-dlq-id"]
    up.script = [reply(400)]
    async with client.post(base + f"/dlq/{rid}/replay", headers=auth) as resp:
        assert (await resp.json())["status"] == "parked"
    up.script = [reply(200)]
    nonce = await form(client, base + "/ui/dlq/replay?route=main")
    data = {"route": "main", "limit": "10", "nonce": nonce, "token": TOKEN}
    async with client.post(base + "/ui/dlq/replay", data=data, allow_redirects=False) as resp:
        assert resp.status == 303
        location = resp.headers["Location"]
    async with client.get(base + f"/dlq/{rid}", headers=auth) as resp:
        assert (await resp.json())["status"] == "delivered"
    async with client.get(base + location) as resp:
        assert "Replayed 1 parked records of main: 1 delivered." in await resp.text()


async def test_without_a_token_forms_work_only_on_a_loopback_host(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    monkeypatch.delenv("RETRY_SIDECAR_ADMIN_TOKEN", raising=False)
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    base = admin(sc)
    page = await (await client.get(base + "/ui/killswitch")).text()
    assert 'type="password"' not in page  # nothing to type
    data = {"scope": "global", "ttl": "1m", "reason": "r", "nonce": nonce_of(page)}
    async with client.post(
        base + "/ui/killswitch",
        data=data,
        headers={"Host": "rebind.evil.example"},
        allow_redirects=False,
    ) as resp:
        assert resp.status == 421  # the admin guard: a Host nobody configured
    data["nonce"] = await form(client, base + "/ui/killswitch")
    async with client.post(base + "/ui/killswitch", data=data, allow_redirects=False) as resp:
        assert resp.status == 303
    assert [s.scope for s in sc.sidecar.kill.active(time.monotonic())] == ["global"]


async def test_the_lift_forms_nonce_does_not_submit_the_set_form(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    """Finding 21 over HTTP: a nonce from /ui/killswitch/lift posted to /ui/killswitch."""
    monkeypatch.delenv("RETRY_SIDECAR_ADMIN_TOKEN", raising=False)
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    base = admin(sc)
    switch = {"scope": "route:main", "ttl": "1m", "reason": "to lift"}
    async with client.put(base + "/killswitch", json=switch) as resp:
        assert resp.status == 200
    data = {"scope": "global", "ttl": "1m", "reason": "r"}
    data["nonce"] = await form(client, base + "/ui/killswitch/lift?scope=route:main")
    async with client.post(base + "/ui/killswitch", data=data, allow_redirects=False) as resp:
        assert resp.status == 403
    assert [s.scope for s in sc.sidecar.kill.active(time.monotonic())] == ["route:main"]
    data["nonce"] = await form(client, base + "/ui/killswitch")
    async with client.post(base + "/ui/killswitch", data=data, allow_redirects=False) as resp:
        assert resp.status == 303

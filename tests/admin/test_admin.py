"""The admin API over real sockets, in-process."""

from __future__ import annotations

import logging

import pytest

from sidecar.admin.auth import AdminStartError
from sidecar.app import Sidecar
from sidecar.config.parse import parse_text
from sidecar.testing import FakeClock
from tests.conftest import reply, routes_yaml

JSON = {"Content-Type": "application/json"}


def admin_url(sc) -> str:
    return f"http://127.0.0.1:{sc.sidecar.admin_port}"


async def test_health_and_readiness(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(admin_url(sc) + "/healthz") as resp:
        assert resp.status == 200
    async with client.get(admin_url(sc) + "/readyz") as resp:
        assert resp.status == 200
    sc.sidecar.life.start_drain()
    async with client.get(admin_url(sc) + "/readyz") as resp:
        assert resp.status == 503
        assert (await resp.json())["status"] == "draining"


async def test_metrics_follow_the_traffic(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/some/raw/path?q=1") as resp:
        assert resp.status == 200
    async with client.get(admin_url(sc) + "/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    assert 'retry_sidecar_requests_total{route="main",fate="success"} 1' in text
    assert 'retry_sidecar_attempts_total{route="main",outcome="503"} 1' in text
    assert 'retry_sidecar_attempts_total{route="main",outcome="200"} 1' in text
    assert 'retry_sidecar_retries_total{route="main"} 1' in text
    assert 'retry_sidecar_breaker_state{route="main"} 0' in text
    assert 'retry_sidecar_kill_switch_active{scope="global"} 0' in text
    assert 'retry_sidecar_request_duration_seconds_count{route="main"} 1' in text
    assert (
        'retry_sidecar_upstream_attempt_duration_seconds_bucket{route="main",le="+Inf"} 2' in text
    )
    assert "retry_sidecar_config_last_reload_successful 1" in text
    assert "/some/raw/path" not in text  # label values never carry raw paths


async def test_config_endpoint_shape(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(admin_url(sc) + "/config") as resp:
        body = await resp.json()
    assert set(body) >= {"version", "loaded_at", "source", "last_error", "routes"}
    assert body["version"] == sc.sidecar.store.current.sha256
    assert body["routes"][0]["name"] == "main" and body["last_error"] is None
    assert body["loaded_at"].endswith("Z")


async def test_kill_switch_put_get_delete_and_effect(
    upstream_factory, sidecar_factory, client, caplog
):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(routes_yaml(up.url))
    base = admin_url(sc)
    caplog.set_level(logging.WARNING, logger="sidecar.audit")
    async with client.put(
        base + "/killswitch",
        json={"scope": "route:main", "ttl": "15m", "reason": "INC-7 retries amplify"},
    ) as resp:
        assert resp.status == 200
        sw = await resp.json()
        assert sw["scope"] == "route:main" and sw["set_by"] == "127.0.0.1"
    # Effective from the very next request.
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "kill-switch"
        assert resp.headers["x-retry-attempts"] == "1"
    async with client.get(base + "/killswitch") as resp:
        [listed] = (await resp.json())["switches"]
        assert set(listed) == {"scope", "reason", "set_by", "set_at", "expires_at", "source"}
        assert listed["source"] == "admin"
        assert listed["reason"] == "INC-7 retries amplify"
    async with client.get(base + "/metrics") as resp:
        assert 'retry_sidecar_kill_switch_active{scope="route:main"} 1' in await resp.text()
    audit = [r for r in caplog.records if r.name == "sidecar.audit"]
    assert (
        audit and audit[0].fields["who"] == "127.0.0.1" and audit[0].fields["scope"] == "route:main"
    )  # type: ignore[attr-defined]
    async with client.delete(base + "/killswitch", params={"scope": "route:main"}) as resp:
        assert resp.status == 200
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-attempts"] == "3"
    async with client.delete(base + "/killswitch", params={"scope": "route:main"}) as resp:
        assert resp.status == 404


async def test_kill_switch_expires_by_itself(upstream_factory, sidecar_factory, client):
    # The sidecar's clock is the test's: the switch is certainly still on for the first
    # request and certainly expired for the second, however slowly the machine runs.
    clock = FakeClock()
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(routes_yaml(up.url), clock=clock)
    async with client.put(
        admin_url(sc) + "/killswitch", json={"scope": "global", "ttl": "300ms", "reason": "short"}
    ) as resp:
        assert resp.status == 200
    clock.advance(0.299)
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "kill-switch"
    clock.advance(0.002)
    async with client.get(sc.url + "/x") as resp:
        assert resp.headers["x-retry-fate"] == "exhausted"
    async with client.get(admin_url(sc) + "/killswitch") as resp:
        assert (await resp.json())["switches"] == []


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1]", "JSON object"),
        (b'{"scope": "route:nope", "ttl": "1m", "reason": "x"}', "scope"),
        (b'{"scope": "everything", "ttl": "1m", "reason": "x"}', "scope"),
        (b'{"scope": "global", "reason": "x"}', "ttl is required"),
        (b'{"scope": "global", "ttl": "soon", "reason": "x"}', "ttl"),
        (b'{"scope": "global", "ttl": "25h", "reason": "x"}', "24h"),
        (b'{"scope": "global", "ttl": "1m"}', "reason"),
        (b'{"scope": "global", "ttl": "1m", "reason": "x", "extra": 1}', "unknown keys"),
    ],
)
async def test_bad_kill_switch_requests_get_400(
    upstream_factory, sidecar_factory, client, body, fragment
):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.put(admin_url(sc) + "/killswitch", data=body, headers=JSON) as resp:
        assert resp.status == 400
        assert fragment in (await resp.json())["error"]
    assert sc.sidecar.kill.active(0.0) == []


async def test_admin_bodies_are_size_limited(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    big = b"{" + b" " * 100_000 + b"}"
    async with client.put(admin_url(sc) + "/killswitch", data=big, headers=JSON) as resp:
        assert resp.status == 413


async def test_token_required_for_non_get_calls(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    monkeypatch.setenv("TEST_ADMIN_TOKEN", "s3cret-token")
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url, admin='admin: {listen: "127.0.0.1:0", token_env: TEST_ADMIN_TOKEN}')
    )
    base = admin_url(sc)
    body = {"scope": "global", "ttl": "1m", "reason": "x"}
    async with client.put(base + "/killswitch", json=body) as resp:
        assert resp.status == 401
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    async with client.put(
        base + "/killswitch", json=body, headers={"Authorization": "Bearer wrong"}
    ) as resp:
        assert resp.status == 401
    async with client.post(base + "/config/reload") as resp:
        assert resp.status == 401
    async with client.get(base + "/killswitch") as resp:
        assert resp.status == 200  # reads need no token
    async with client.put(
        base + "/killswitch", json=body, headers={"Authorization": "Bearer s3cret-token"}
    ) as resp:
        assert resp.status == 200


async def test_non_loopback_admin_without_token_refuses_to_start(upstream_factory, monkeypatch):
    monkeypatch.delenv("RETRY_SIDECAR_ADMIN_TOKEN", raising=False)
    up = await upstream_factory(reply(200))
    sc = Sidecar(parse_text(routes_yaml(up.url, admin='admin: {listen: "0.0.0.0:0"}')))
    with pytest.raises(AdminStartError, match="not loopback and no admin token"):
        await sc.start()
    assert sc.proxy_port == 0  # nothing was listening


async def test_admin_and_proxy_ports_stay_apart(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url).replace(
            "    upstream:", "    match: {path_prefix: /api}\n    upstream:"
        )
    )
    async with client.get(admin_url(sc) + "/api/orders") as resp:
        assert resp.status == 404
    async with client.get(sc.url + "/healthz") as resp:
        assert resp.status == 404
        assert "no route" in (await resp.json())["error"]
    async with client.get(sc.url + "/metrics") as resp:
        assert resp.status == 404
    assert up.seen == []


async def test_breakers_endpoint(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503))
    sc = await sidecar_factory(
        routes_yaml(up.url, "    retry: {attempts: 1}\n    breaker: {min_sequences: 2}")
    )
    for _ in range(2):
        async with client.get(sc.url + "/x") as resp:
            await resp.read()
    async with client.get(admin_url(sc) + "/breakers") as resp:
        b = (await resp.json())["routes"]["main"]
    assert b["state"] == "open" and b["sequences"] == 2 and b["failures"] == 2
    assert b["opened_at"].endswith("Z")


async def test_one_json_access_log_line_per_request_at_info(
    upstream_factory, sidecar_factory, client, caplog
):
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    caplog.set_level(logging.INFO, logger="sidecar.access")
    async with client.get(sc.url + "/logged") as resp:
        assert resp.status == 200
    [rec] = [r for r in caplog.records if r.name == "sidecar.access"]
    fields = rec.fields  # type: ignore[attr-defined]
    assert fields["route"] == "main" and fields["fate"] == "success" and fields["attempts"] == 2
    from sidecar.telemetry.logs import JsonFormatter

    assert '"fate": "success"' in JsonFormatter().format(rec)

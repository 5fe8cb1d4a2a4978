"""Bad input over real sockets: size limits, slow clients, smuggling shapes, the C parser check,
malformed-request accounting, and the admin side's secrets."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import reply, routes_yaml
from tests.rawhttp import raw_request

FAST = "limits: {header_timeout: 500ms, body_idle_timeout: 500ms}"


def status_of(raw: bytes) -> int:
    assert raw.startswith(b"HTTP/1."), raw[:100]
    return int(raw.split(b" ", 2)[1])


async def proxy(upstream_factory, sidecar_factory, top: str = FAST):
    up = await upstream_factory(reply(200, b"fine"))
    sc = await sidecar_factory(routes_yaml(up.url, top_extra=top))
    return up, sc


# -- sizes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: h\r\n\r\n",  # request line over 8190
        b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"b" * 9000 + b"\r\n\r\n",  # one field over 8190
        b"GET / HTTP/1.1\r\nHost: h\r\n"
        + b"".join(b"X-%d: v\r\n" % i for i in range(120))
        + b"\r\n",
    ],
    ids=["request-line", "header-field", "too-many-fields"],
)
async def test_oversized_heads_get_431(upstream_factory, sidecar_factory, request_bytes):
    up, sc = await proxy(upstream_factory, sidecar_factory)
    out = await raw_request(sc.sidecar.proxy_port, request_bytes, 3.0)
    assert status_of(out) == 431
    assert b"x-retry-proxy-error: bad-request" in out.lower()
    assert up.seen == []
    assert 'malformed_requests_total{reason="header-too-large"} 1' in sc.sidecar.metrics.render()


async def test_total_header_bytes_are_bounded_by_config(upstream_factory, sidecar_factory):
    up, sc = await proxy(upstream_factory, sidecar_factory, "limits: {max_header_bytes: 2KiB}")
    headers = b"".join(b"X-%d: %s\r\n" % (i, b"v" * 500) for i in range(6))
    out = await raw_request(
        sc.sidecar.proxy_port,
        b"GET / HTTP/1.1\r\nHost: h\r\n" + headers + b"Connection: close\r\n\r\n",
        3.0,
    )
    assert status_of(out) == 431
    assert up.seen == []


async def test_body_over_the_maximum_gets_413_before_any_upstream_call(
    upstream_factory, sidecar_factory
):
    up, sc = await proxy(upstream_factory, sidecar_factory, "limits: {max_request_body: 1KiB}")
    out = await raw_request(
        sc.sidecar.proxy_port,
        b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\nConnection: close\r\n\r\n"
        + b"z" * 5000,
        3.0,
    )
    assert status_of(out) == 413
    assert up.seen == []


async def test_memory_stays_flat_under_oversized_heads(upstream_factory, sidecar_factory):
    import resource

    _up, sc = await proxy(upstream_factory, sidecar_factory)
    req = b"GET / HTTP/1.1\r\nHost: h\r\nX-Big: " + b"b" * 20000 + b"\r\n\r\n"
    await asyncio.gather(*(raw_request(sc.sidecar.proxy_port, req, 3.0) for _ in range(20)))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(10):
        outs = await asyncio.gather(
            *(raw_request(sc.sidecar.proxy_port, req, 3.0) for _ in range(50))
        )
        assert all(status_of(o) == 431 for o in outs)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert after - before < 20_000  # KiB: 500 refused heads must not grow the process by 20 MB


# -- slow clients -----------------------------------------------------------------------------


async def test_trickled_head_is_cut_with_408_while_others_are_served(
    upstream_factory, sidecar_factory, client
):
    up, sc = await proxy(upstream_factory, sidecar_factory)
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"GET / HTTP/1.1\r\n")
    await w.drain()
    started = time.monotonic()
    trickle_task = asyncio.create_task(r.read(4096))

    async def trickle() -> None:
        for i in range(20):
            await asyncio.sleep(0.1)
            if trickle_task.done():
                return
            try:
                w.write(b"X-%d: v\r\n" % i)
                await w.drain()
            except ConnectionError:
                return

    t = asyncio.create_task(trickle())
    # Meanwhile a fast client is served.
    async with client.get(sc.url + "/fast") as resp:
        assert resp.status == 200
    out = await asyncio.wait_for(trickle_task, 5)
    t.cancel()
    assert status_of(out) == 408
    assert (
        time.monotonic() - started < 5
    )  # the header timeout is 0.5 s; aiohttp alone waits forever
    assert [s.raw_path for s in up.seen] == ["/fast"]
    w.close()
    assert 'malformed_requests_total{reason="header-timeout"} 1' in sc.sidecar.metrics.render()


@pytest.mark.slow
async def test_idle_keep_alive_connection_is_not_cut_by_the_header_deadline(
    upstream_factory, sidecar_factory
):
    _up, sc = await proxy(upstream_factory, sidecar_factory)
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    for _ in range(2):
        w.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
        await w.drain()
        head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        await r.readexactly(4)
        await asyncio.sleep(0.8)  # idle longer than the header timeout between requests
    w.close()


async def test_stalled_body_is_cut_with_408_and_nothing_is_stored(
    upstream_factory, sidecar_factory, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    dlq: {enabled: true}\n    retry: {max_body_bytes: 16}",
            top_extra=FAST + f'\ndlq: {{path: "{db}"}}',
        )
    )
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(
        b"POST /w HTTP/1.1\r\nHost: h\r\nContent-Length: 1000\r\nIdempotency-Key: k\r\n\r\n"
        + b"a" * 100
    )
    await w.drain()
    out = await asyncio.wait_for(r.read(4096), 5)
    assert status_of(out) == 408
    w.close()
    await asyncio.sleep(0.2)
    # The upstream saw at most an aborted request, never a whole one, and nothing went to the DLQ.
    assert all(len(s.body) < 1000 for s in up.seen)
    import sqlite3

    assert sqlite3.connect(db).execute("SELECT COUNT(*) FROM records").fetchone()[0] == 0


# -- smuggling shapes --------------------------------------------------------------------------

SMUGGLING = {
    "cl-and-te": b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "duplicate-cl": b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nabcde",
    "cl-list": b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4, 4\r\n\r\nabcd",
    "cl-plus": b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: +4\r\n\r\nabcd",
    "cl-negative": b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: -1\r\n\r\n",
    "cl-garbage": b"POST / HTTP/1.1\r\nHost: h\r\nContent-Length: 4x\r\n\r\nabcd",
    "te-obfuscated": b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: xchunked\r\n\r\n0\r\n\r\n",
    "te-space-before-colon": b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding : chunked\r\n\r\n0\r\n\r\n",
    "te-not-last": b"POST / HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n",
    "bare-lf": b"GET / HTTP/1.1\nHost: h\n\n",
    "obs-fold": b"GET / HTTP/1.1\r\nHost: h\r\nX-A: one\r\n two\r\n\r\n",
    "control-char": b"GET / HTTP/1.1\r\nHost: h\r\nX-A: o\x01ne\r\n\r\n",
    "nul-in-target": b"GET /a\x00b HTTP/1.1\r\nHost: h\r\n\r\n",
    "http-1.2": b"GET / HTTP/1.2\r\nHost: h\r\n\r\n",
    "http-2.0": b"GET / HTTP/2.0\r\nHost: h\r\n\r\n",
    "http-0.9": b"GET /\r\n\r\n",
}


@pytest.mark.parametrize("name", sorted(SMUGGLING))
async def test_smuggling_shapes_are_rejected_and_never_forwarded(
    upstream_factory, sidecar_factory, name
):
    up, sc = await proxy(upstream_factory, sidecar_factory)
    out = await raw_request(sc.sidecar.proxy_port, SMUGGLING[name], 3.0)
    if out:
        assert status_of(out) in (400, 505), out[:200]
    assert up.seen == [], name


async def test_malformed_requests_are_counted_and_logged_at_a_bounded_rate(
    upstream_factory, sidecar_factory, caplog
):
    _up, sc = await proxy(upstream_factory, sidecar_factory)
    caplog.set_level(logging.DEBUG)
    for _ in range(40):
        await raw_request(sc.sidecar.proxy_port, SMUGGLING["cl-and-te"], 3.0)
    text = sc.sidecar.metrics.render()
    assert 'malformed_requests_total{reason="malformed"} 40' in text
    warnings = [
        r for r in caplog.records if r.levelno >= logging.WARNING and "malformed" in r.getMessage()
    ]
    assert 1 <= len(warnings) <= 10
    assert not any(r.exc_info for r in caplog.records)  # never a traceback per request


def test_refuses_to_run_on_the_pure_python_parser(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("version: 1\nroutes:\n  - name: a\n    upstream: http://127.0.0.1:1\n")
    env = {**os.environ, "AIOHTTP_NO_EXTENSIONS": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "run", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    assert res.returncode == 2
    assert "C HTTP parser is not in use" in res.stderr


# -- forwarding rules an attacker would try ----------------------------------------------------


async def test_connection_header_cannot_remove_the_sidecars_headers(
    upstream_factory, sidecar_factory
):
    up, sc = await proxy(upstream_factory, sidecar_factory)
    req = (
        b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close, x-retry-edge, x-request-timeout-ms, "
        b"x-forwarded-for, tracestate\r\nX-Forwarded-For: 1.2.3.4\r\n"
        b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01\r\n\r\n"
    )
    out = await raw_request(sc.sidecar.proxy_port, req, 3.0)
    assert status_of(out) == 200
    s = up.seen[0]
    assert s.header("x-retry-edge") == "test-edge"
    assert s.header("x-request-timeout-ms") is not None
    assert s.header("x-retry-attempt") == "1"
    # The client's value is kept (as for any X-Forwarded-For) and the real peer appended.
    assert s.header("X-Forwarded-For") == "1.2.3.4, 127.0.0.1"
    assert "retry-sidecar=edge" in (s.header("tracestate") or "")


# -- the admin side ----------------------------------------------------------------------------


async def test_admin_token_is_never_logged(
    upstream_factory, sidecar_factory, client, caplog, monkeypatch
):
    monkeypatch.setenv("HARD_TOKEN", "t0ps3cret-value")
    caplog.set_level(logging.DEBUG)
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url, admin='admin: {listen: "127.0.0.1:0", token_env: HARD_TOKEN}')
    )
    base = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    body = {"scope": "global", "ttl": "1m", "reason": "r"}
    for token in ("wrong", "t0ps3cret-value"):
        async with client.put(
            base + "/killswitch", json=body, headers={"Authorization": f"Bearer {token}"}
        ) as r:
            await r.read()
    assert r.status == 200
    assert not any(
        "t0ps3cret" in rec.getMessage() or "t0ps3cret" in str(getattr(rec, "fields", ""))
        for rec in caplog.records
    )
    async with client.get(base + "/config") as r:
        assert "t0ps3cret" not in await r.text()


async def test_idle_client_connections_are_closed_after_the_keepalive_timeout(
    upstream_factory, sidecar_factory
):
    _up, sc = await proxy(upstream_factory, sidecar_factory, "limits: {keepalive_timeout: 300ms}")
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"GET / HTTP/1.1\r\nHost: h\r\n\r\n")
    await w.drain()
    head = await r.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    await r.readexactly(4)
    assert await asyncio.wait_for(r.read(1), 5) == b""  # closed by the sidecar when idle
    w.close()

"""The JSON logs of the real process: the access log (one line per request at info, off with
``access_log: false``) and the trace ids on every line written while a request is traced."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import aiohttp

from tests.conftest import reply
from tests.proc import SidecarProcess, free_port, launched

INCOMING = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def run_sidecar(
    tmp_path: Path, upstream: str, top: str, env: dict[str, str]
) -> SidecarProcess:
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n{top}\n'
        f'routes:\n  - name: orders\n    upstream: "{upstream}"\n'
        "    retry: {attempts: 2, backoff: {base: 1ms, max: 1ms}}\n"
    )
    proc = await launched(cfg, port, admin, env=env)
    proc.port = port  # type: ignore[attr-defined]
    proc.admin = admin  # type: ignore[attr-defined]
    return proc


def _lines(proc: SidecarProcess, logger: str) -> list[dict[str, object]]:
    out = []
    for line in proc.stderr().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("logger") == logger:
            out.append(rec)
    return out


async def _access_lines(proc: SidecarProcess, n: int) -> list[dict[str, object]]:
    for _ in range(100):
        got = _lines(proc, "sidecar.access")
        if len(got) >= n:
            return got
        await asyncio.sleep(0.05)
    return _lines(proc, "sidecar.access")


async def test_access_log_by_default_with_trace_ids(tmp_path, upstream_factory):
    up = await upstream_factory(reply(503), reply(200, b"hello"))
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    proc = await run_sidecar(tmp_path, up.url, "", env)
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{proc.port}/orders/7?token=secret"  # type: ignore[attr-defined]
            async with s.get(url, headers={"traceparent": INCOMING}) as resp:
                assert resp.status == 200
                assert await resp.read() == b"hello"
        [line] = await _access_lines(proc, 1)
    finally:
        proc.terminate()
    assert line["level"] == "info" and line["msg"] == "access"
    assert line["method"] == "GET" and line["route"] == "orders"
    assert line["path"] == "/orders/7"  # the query (a token) never logged
    assert "secret" not in json.dumps(line)
    assert line["status"] == 200 and line["attempts"] == 2 and line["fate"] == "success"
    assert line["bytes"] == 5
    assert line["upstream"] == f"127.0.0.1:{up.url.rsplit(':', 1)[1]}"
    assert isinstance(line["duration"], float) and line["duration"] >= 0
    # The caller's trace, and the request's own span (not the caller's).
    assert line["trace_id"] == "0af7651916cd43dd8448eb211c80319c"
    span_id = line["span_id"]
    assert isinstance(span_id, str) and len(span_id) == 16 and span_id != "b7ad6b7169203331"
    int(span_id, 16)


async def test_lines_of_an_untraced_request_carry_no_trace_ids(tmp_path, upstream_factory):
    up = await upstream_factory(reply(200))
    proc = await run_sidecar(tmp_path, up.url, "", {"OTEL_TRACES_EXPORTER": "none"})
    try:
        async with aiohttp.ClientSession() as s:
            for _ in range(2):
                url = f"http://127.0.0.1:{proc.port}/x"  # type: ignore[attr-defined]
                async with s.get(url, headers={"traceparent": INCOMING}) as resp:
                    assert resp.status == 200
        lines = await _access_lines(proc, 2)
    finally:
        proc.terminate()
    assert len(lines) == 2
    assert all("trace_id" not in x and "span_id" not in x for x in lines)


async def test_access_log_off_with_one_key(tmp_path, upstream_factory):
    up = await upstream_factory(reply(200))
    proc = await run_sidecar(tmp_path, up.url, "telemetry: {access_log: false}", {})
    try:
        url = f"http://127.0.0.1:{proc.port}/x"  # type: ignore[attr-defined]
        async with aiohttp.ClientSession() as s, s.get(url) as resp:
            assert resp.status == 200
        await asyncio.sleep(0.3)
    finally:
        proc.terminate()
    assert _lines(proc, "sidecar.access") == []
    assert _lines(proc, "sidecar.app") or proc.stderr()  # the process did log (not mute)


async def test_requests_refused_before_routing_have_their_access_line(tmp_path, upstream_factory):
    """As nginx logs its 400s and 404s: a request no route takes, and heads the server refuses
    before any route (malformed, too large), each get a line: no route, no attempt."""
    up = await upstream_factory(reply(200))
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n'
        f'routes:\n  - {{name: api, upstream: "{up.url}", match: {{path_prefix: /api/}}}}\n'
    )
    proc = await launched(cfg, port, admin)
    try:
        url = f"http://127.0.0.1:{port}/elsewhere?token=secret"
        async with aiohttp.ClientSession() as s, s.get(url) as resp:
            assert resp.status == 404
        for raw in (
            b"GET /x HTTP/1.1\r\nHost: a b\r\nBad Header\r\n\r\n",
            b"GET /x HTTP/1.1\r\nHost: a\r\nX-Big: " + b"y" * 40_000 + b"\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.sendall(raw)
                c.settimeout(5)
                assert c.recv(100)[9:10] == b"4"  # a 4xx, as HTTP/1.0 or 1.1
        lines = await _access_lines(proc, 3)
    finally:
        proc.terminate()
    assert len(lines) == 3, lines
    first = lines[0]
    assert (first["method"], first["path"], first["status"], first["route"]) == (
        "GET",
        "/elsewhere",
        404,
        None,
    )
    assert first["attempts"] == 0 and first["upstream"] is None
    assert first["proxy_error"] == "bad-request" and "secret" not in json.dumps(lines)
    assert all(line["status"] in (400, 431) for line in lines[1:]), lines
    assert all(line["route"] is None and line["method"] is None for line in lines[1:])

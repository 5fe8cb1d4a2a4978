"""``https://`` upstreams through the real sidecar process against real TLS peers on loopback
(nginx with ``ssl``, ``tests/tlspeers.py``), never a mock: every failure kind with its status,
``x-retry-proxy-error``, ``Proxy-Status`` and the attempts the upstream saw; SNI is the URL's
host name, never the address it resolved to; keep-alive connections reused; TLS sessions
resumed; a handshake cut half-way gives its socket and pool slot back."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import tlspeers
from tests.proc import free_port, launched
from tests.tlspeers import World

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")


def config(p: tlspeers.Peers, port: int, admin: int) -> str:
    ca, c = p.certs.ca, p.certs
    ports = p.ports

    def route(name: str, upstream: str, tls: str = f"{{ca_file: {ca}}}", extra: str = "") -> str:
        return (
            f"  - name: {name}\n    match: {{path_prefix: /{name}/}}\n"
            f'    upstream: "{upstream}"\n    tls: {tls}\n{extra}'
        )

    silent = p.silent.getsockname()[1]
    return (
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n'
        "upstream_pool: {connect_timeout: 300ms}\n"
        "defaults:\n  retry: {backoff: {strategy: constant, base: 1ms, max: 1ms}}\n"
        "  breaker: {min_sequences: 1000000}\n  budget: {min_per_second: 1000}\n"
        "routes:\n"
        + route("ok", f"https://localhost:{ports['ok']}")
        + route("churn", f"https://localhost:{ports['churn']}")
        + route("unknown-ca", f"https://localhost:{ports['ok']}", f"{{ca_file: {c.other_ca}}}")
        + route("wrong-name", f"https://localhost:{ports['wrong']}")
        + route("expired", f"https://localhost:{ports['expired']}")
        + route("alert", f"https://localhost:{ports['reject']}")
        + route("plain", f"https://localhost:{ports['plain']}")
        + route("refused", f"https://localhost:{p.closed_port}")
        + route("silent", f"https://localhost:{silent}")
        + route("mtls-none", f"https://localhost:{ports['mtls']}")
        + route(
            "mtls",
            f"https://localhost:{ports['mtls']}",
            f"{{ca_file: {ca}, client_cert: {c.client.cert}, client_key: {c.client.key}}}",
        )
        + route("wants-cert", f"https://localhost:{p.s_server_port}")
        + route("noverify", f"https://localhost:{ports['expired']}", "{verify: false}")
        + route(
            "by-address",
            f"https://127.0.0.1:{ports['ok']}",
            f"{{ca_file: {ca}, server_name: localhost}}",
        )
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("tls-up")
    peers = tlspeers.start(root / "nginx")
    port, admin = free_port(), free_port()
    cfg = root / "sidecar.yaml"
    cfg.write_text(config(peers, port, admin))
    try:
        proc = asyncio.run(launched(cfg, port, admin))
    except BaseException:
        peers.close()
        raise
    try:
        yield World(peers, proc, port, admin)
    finally:
        proc.terminate()
        peers.close()


def request(
    port: int, method: str, target: str, body: bytes | None = None
) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        c.request(method, target, body=body)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def admin_json(w: World, path: str) -> dict[str, object]:
    status, _, body = request(w.admin, "GET", path)
    assert status == 200, body
    out: dict[str, object] = json.loads(body)
    return out


def metric(w: World, name: str, **labels: str) -> float:
    _, _, body = request(w.admin, "GET", "/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in body.decode().splitlines():
        if line.startswith(f"{name}{{{want}}} "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# (route, method, status, x-retry-proxy-error, Proxy-Status error, attempts, upstream log)
FAILURES = [
    ("unknown-ca", "GET", 502, "tls-certificate", "tls_certificate_error", 1, "ok"),
    ("wrong-name", "GET", 502, "tls-certificate", "tls_certificate_error", 1, "wrong"),
    ("expired", "GET", 502, "tls-certificate", "tls_certificate_error", 1, "expired"),
    ("expired", "POST", 502, "tls-certificate", "tls_certificate_error", 1, "expired"),
    ("alert", "GET", 502, "tls-handshake", "tls_alert_received", 1, "reject"),
    ("plain", "GET", 502, "tls-handshake", "tls_protocol_error", 1, "plain"),
    # TLS 1.3: the client certificate is asked for after the client's side of the handshake,
    # the alert comes in place of the answer (openssl s_server -Verify 1)
    ("wants-cert", "GET", 502, "tls-handshake", "tls_alert_received", 1, None),
    ("wants-cert", "POST", 502, "tls-handshake", "tls_alert_received", 1, None),
    # transient: no byte of the request sent, so retried for any method (3 attempts)
    ("refused", "GET", 502, "connect-failure", "connection_refused", 3, None),
    ("refused", "POST", 502, "connect-failure", "connection_refused", 3, None),
    ("silent", "POST", 502, "connect-failure", "connection_timeout", 3, None),
]


@pytest.mark.parametrize(
    ("route", "method", "status", "code", "error", "attempts", "log"),
    FAILURES,
    ids=[f"{f[0]}-{f[1]}" for f in FAILURES],
)
def test_each_failure_kind(
    world: World,
    route: str,
    method: str,
    status: int,
    code: str,
    error: str,
    attempts: int,
    log: str | None,
) -> None:
    if log is not None:
        world.peers.new_lines(log)
    got, headers, body = request(
        world.port, method, f"/{route}/x", b"a write" if method == "POST" else None
    )
    assert got == status, body
    assert headers["x-retry-proxy-error"] == code
    assert headers["proxy-status"] == f"retry-sidecar; error={error}"
    assert headers["x-retry-attempts"] == str(attempts)
    if log is not None:  # no request reached the upstream's app (a ClientHello to a plaintext
        # server is logged as a request line it could not read: "-")
        assert [ln for ln in world.peers.new_lines(log) if ln.split()[1] != "-"] == []


def test_a_refused_certificate_is_logged_with_its_reason_and_counted(world: World) -> None:
    for route in ("unknown-ca", "wrong-name", "expired", "ok"):
        request(world.port, "GET", f"/{route}/again")
    text = world.sidecar.stderr()
    assert "unable to get local issuer certificate" in text
    assert "Hostname mismatch" in text or "not valid for 'localhost'" in text
    assert "certificate has expired" in text
    assert (
        metric(
            world, "retry_sidecar_tls_handshakes_total", side="upstream", result="tls-certificate"
        )
        >= 3
    )
    assert (
        metric(world, "retry_sidecar_tls_handshakes_total", side="upstream", result="tls-handshake")
        >= 1
    )
    assert metric(world, "retry_sidecar_tls_handshakes_total", side="upstream", result="ok") >= 1


def test_verified_by_name_never_the_address_and_kept_alive(world: World) -> None:
    world.peers.new_lines("ok")
    for _ in range(5):
        status, _, body = request(world.port, "GET", "/ok/hello")
        assert status == 200 and body == b"ok sni=localhost\n", body
    status, _, body = request(world.port, "GET", "/by-address/hello")
    assert status == 200 and body == b"ok sni=localhost\n"  # server_name: SNI and verified
    lines = world.peers.new_lines("ok")
    assert len(lines) == 6
    assert all("sni=localhost" in ln for ln in lines)
    conns = {re.search(r"conn=(\d+)", ln).group(1) for ln in lines[:5]}  # type: ignore[union-attr]
    assert len(conns) == 1, lines  # one pooled keep-alive connection for the five


def test_retries_over_tls(world: World) -> None:
    world.peers.new_lines("ok")
    status, headers, _ = request(world.port, "GET", "/ok/503")
    assert status == 503 and headers["x-retry-attempts"] == "3"
    assert len(world.peers.new_lines("ok")) == 3


def test_a_new_connection_resumes_the_tls_session(world: World) -> None:
    """nginx closes each connection after one request here: every request needs a new
    connection, and after the first each one resumes the session (no full handshake)."""
    world.peers.new_lines("churn")
    for _ in range(4):
        status, _, _ = request(world.port, "GET", "/churn/x")
        assert status == 200
    lines = world.peers.new_lines("churn")
    reused = [re.search(r"reused=(\S)", ln).group(1) for ln in lines]  # type: ignore[union-attr]
    assert len(lines) == 4 and reused[0] == "." and reused[1:] == ["r", "r", "r"], lines


def test_mutual_tls(world: World) -> None:
    status, _, body = request(world.port, "GET", "/mtls/x")
    assert status == 200 and b"O=trustme" in body, body  # its subject, as nginx saw it
    # Without a certificate nginx (ssl_verify_client on) answers 400 itself, in HTTP: relayed
    status, headers, body = request(world.port, "GET", "/mtls-none/x")
    assert status == 400 and "x-retry-proxy-error" not in headers
    assert b"No required SSL certificate" in body


def _pool(w: World, route_port: int) -> dict[str, int]:
    pools = admin_json(w, "/stats")["pool"]
    assert isinstance(pools, dict)
    return {k: v["total"] for k, v in pools.items() if f":{route_port} " in k}


def _fds(w: World) -> int:
    fds = admin_json(w, "/stats")["open_fds"]
    assert isinstance(fds, int)
    return fds


def test_a_handshake_never_answered_gives_back_socket_and_slot(world: World) -> None:
    silent = world.peers.silent.getsockname()[1]
    request(world.port, "GET", "/silent/warm")
    before = _fds(world)
    status, headers, _ = request(world.port, "GET", "/silent/x")
    assert status == 502 and headers["x-retry-attempts"] == "3"
    assert set(_pool(world, silent).values()) <= {0}
    assert _fds(world) == before


def test_a_client_gone_during_the_handshake_gives_back_socket_and_slot(world: World) -> None:
    silent = world.peers.silent.getsockname()[1]
    request(world.port, "GET", "/silent/warm")
    before = _fds(world)
    for _ in range(5):
        s = socket.create_connection(("127.0.0.1", world.port))
        s.sendall(b"GET /silent/gone HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)  # the sidecar is in the handshake now (300 ms before it times out)
        s.close()
    time.sleep(0.5)
    assert set(_pool(world, silent).values()) <= {0}
    assert _fds(world) == before


def test_sigterm_during_a_handshake(tmp_path: Path, world: World) -> None:
    """A drain with a request waiting on a handshake that never comes: the attempt times out
    (connect-failure, retried within the drain), the client gets its answer, the process ends
    cleanly with nothing left open."""
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(config(world.peers, port, admin))
    proc = asyncio.run(launched(cfg, port, admin))
    try:
        s = socket.create_connection(("127.0.0.1", port))
        s.settimeout(10)
        s.sendall(b"GET /silent/term HTTP/1.1\r\nHost: x\r\n\r\n")
        time.sleep(0.1)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        answer = s.recv(65536)
        s.close()
        assert answer.startswith(b"HTTP/1.1 502"), answer
        assert proc.proc.wait(15) == 0
    finally:
        proc.terminate()
    log = proc.stderr()
    assert "Unclosed" not in log and "was destroyed but it is pending" not in log, log[-2000:]


def test_verify_false_is_warned_of_at_start_in_explain_and_on_the_status_page(world: World) -> None:
    status, _, body = request(world.port, "GET", "/noverify/x")
    assert status == 200 and body == b"expired\n"  # any certificate taken, as it says
    assert "verify: false" in world.sidecar.stderr()
    routes = {r["name"]: r for r in admin_json(world, "/status")["routes"]}  # type: ignore[attr-defined]
    assert routes["noverify"]["tls_verify"] is False
    assert "NOT VERIFIED" in routes["noverify"]["tls"]
    assert routes["ok"]["tls_verify"] is True and routes["ok"]["tls"] == "verified"
    _, _, page = request(world.admin, "GET", "/")
    assert b"NOT VERIFIED" in page
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "explain", str(world.sidecar.config_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert f"tls: chain verified against {world.peers.certs.ca}, name localhost" in out
    assert "tls: NOT VERIFIED (verify: false)" in out
    assert f"client certificate {world.peers.certs.client.cert}" in out


def test_the_client_certificate_subject_and_expiry_are_shown_and_exported(world: World) -> None:
    routes = {r["name"]: r for r in admin_json(world, "/status")["routes"]}  # type: ignore[attr-defined]
    mtls = routes["mtls"]
    assert "O=trustme" in mtls["client_cert_subject"]
    left = mtls["client_cert_not_after"] - time.time()
    assert left > 14 * 86400
    assert "client cert" in mtls["tls"] and "expires" in mtls["tls"]
    assert routes["ok"]["client_cert_subject"] is None
    gauge = metric(world, "retry_sidecar_tls_cert_expiry_seconds", use="route:mtls")
    assert abs(gauge - left) < 60

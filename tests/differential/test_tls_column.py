"""The differential suite's TLS column: what the upstream application receives through the
sidecar over TLS (an ``https://`` route, verified) equals what it receives through nginx with
``proxy_pass https://`` and ``proxy_ssl_verify on``. The same recording app (tests/difftools.py)
serves HTTPS with a leaf of tests/tlscerts.py; a few requests of each shape, kept small and
fast: bodyless, buffered and streamed bodies, chunked, HTTP/1.0, keep-alive and close."""

from __future__ import annotations

import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import difftools as d
from tests import tlscerts


@dataclass
class TlsWorld:
    upstream: d.RecordingUpstream
    nginx_port: int
    sidecar_port: int


@pytest.fixture(scope="module")
def tls_world() -> Iterator[TlsWorld]:
    if not d.nginx_available():
        pytest.skip("nginx is not installed: the TLS column needs it as reference")
    tmp = d.make_tmp()
    certs = tlscerts.make(tmp / "certs")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(certs.server.cert, certs.server.key)
    up = d.RecordingUpstream(tls=ctx)
    procs = []
    try:
        ngx = d.free_port()
        procs.append(d.start_nginx_tls_proxy(ngx, up.tls_port, certs.ca, tmp / "nginx-tls"))
        port, admin = d.free_port(), d.free_port()
        config = tmp / "tls.yaml"
        config.write_text(
            f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n'
            "limits: {max_request_body: 16MiB}\n"
            "defaults:\n  breaker: {min_sequences: 1000000}\n"
            f'routes:\n  - name: up\n    upstream: "https://localhost:{up.tls_port}"\n'
            f"    tls: {{ca_file: {certs.ca}}}\n"
        )
        procs.append(d.start_sidecar(config, port))
        yield TlsWorld(up, ngx, port)
    finally:
        for p in reversed(procs):
            d.stop(p)
        up.close()


def _request(version: bytes, method: bytes, target: bytes, body: bytes, chunked: bool) -> bytes:
    head = b"%s %s %s\r\nHost: up.test\r\nX-Case: tls\r\nAccept: */*\r\n" % (
        method,
        target,
        version,
    )
    if version == b"HTTP/1.1":
        head += b"Connection: close\r\n"
    if chunked:
        framed = b"".join(
            b"%x\r\n%b\r\n" % (len(body[i : i + 7000]), body[i : i + 7000])
            for i in range(0, len(body), 7000)
        )
        return head + b"Transfer-Encoding: chunked\r\n\r\n" + framed + b"0\r\n\r\n"
    if body or method in (b"POST", b"PUT"):
        head += b"Content-Length: %d\r\n" % len(body)
    return head + b"\r\n" + body


BODY = bytes(range(256)) * 4096  # 1 MiB: over max_body_bytes, streamed
CASES = {
    "get": (b"HTTP/1.1", b"GET", b"/get?a=1&b=%20x", b"", False),
    "get-http10": (b"HTTP/1.0", b"GET", b"/old", b"", False),
    "post-small": (b"HTTP/1.1", b"POST", b"/post", b'{"a": 1}', False),
    "put-1m": (b"HTTP/1.1", b"PUT", b"/up/big", BODY, False),
    "put-chunked": (b"HTTP/1.1", b"PUT", b"/up/chunked", BODY[:100_000], True),
    "delete": (b"HTTP/1.1", b"DELETE", b"/thing/1", b"", False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_upstream_receives_over_tls_what_nginx_sends_it(tls_world: TlsWorld, name: str):
    data = _request(*CASES[name])
    results = []
    for port in (tls_world.nginx_port, tls_world.sidecar_port):
        raw = d.send_in_pieces(port, [data])
        statuses = [r.status for r in d.parse_responses(raw, [CASES[name][1].decode()])]
        results.append((statuses, [d.received_comparable(g) for g in tls_world.upstream.take()]))
    (ngx_status, ngx_seen), (sc_status, sc_seen) = results
    assert ngx_status == [200] and len(ngx_seen) == 1, (ngx_status, ngx_seen)
    assert sc_status == ngx_status
    assert sc_seen == ngx_seen
    # The upstream's own name as Host (it is what SNI said), never the client's up.test
    assert ("host", f"localhost:{tls_world.upstream.tls_port}") in sc_seen[0]["headers"]


def test_the_comparison_sees_a_difference(tls_world: TlsWorld, tmp_path: Path):
    """The comparison is not blind: two different requests compare unequal."""
    d.send_in_pieces(tls_world.sidecar_port, [_request(*CASES["get"])])
    d.send_in_pieces(tls_world.sidecar_port, [_request(*CASES["delete"])])
    a, b = (d.received_comparable(g) for g in tls_world.upstream.take())
    assert a != b

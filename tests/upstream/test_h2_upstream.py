"""HTTP/2 to the upstream (``upstream_protocol: h2``), through the real sidecar process, against
a real h2 server (tests/h2peer.py) and nginx as the reference h2c server: the request mapped as
RFC 9113 section 8.2 says, streams of one connection, what was not processed retried, trailers
relayed to an HTTP/2 client, flow control bounding what is buffered, and a client that leaves
resetting its upstream stream."""

from __future__ import annotations

import asyncio
import json
import random
from contextlib import AbstractAsyncContextManager
from pathlib import Path

import aiohttp
import pytest
from h2.errors import ErrorCodes

from tests import tlscerts
from tests.difftools import run_nginx, stop, wait_port
from tests.grpcclient import raw_call
from tests.h2peer import Seen, serving
from tests.proc import SidecarProcess, free_port, launched, proxying


def through(
    tmp_path: Path, upstream_port: int, route: str = ""
) -> AbstractAsyncContextManager[tuple[int, int, SidecarProcess]]:
    """The real sidecar with one route speaking HTTP/2 (h2c) to the upstream on that port."""
    return proxying(
        tmp_path, f"http://127.0.0.1:{upstream_port}", "    upstream_protocol: h2\n" + route
    )


async def get(port: int, path: str, **kw: object) -> tuple[int, dict[str, str], bytes]:
    async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{port}{path}", **kw) as r:  # type: ignore[arg-type]
        return r.status, dict(r.headers), await r.read()


async def test_an_http1_request_reaches_the_h2_upstream_mapped_as_rfc_9113_says(
    tmp_path: Path,
) -> None:
    async with serving() as (up, _), through(tmp_path, up) as (port, _, _):
        status, headers, body = await get(
            port,
            "/echo?q=1",
            headers={"Connection": "keep-alive, X-Hop", "X-Hop": "1", "TE": "gzip", "X-App": "v"},
        )
        assert status == 200 and headers["x-retry-attempts"] == "1"
        fields = dict((k, v) for k, v in json.loads(body)["fields"])
    assert fields[":method"] == "GET" and fields[":path"] == "/echo?q=1"
    assert (
        fields[":scheme"] == "http" and fields[":authority"] == f"127.0.0.1:{port}"
    )  # the Host as sent
    assert fields["x-app"] == "v" and fields["x-retry-attempt"] == "1"
    for gone in ("connection", "x-hop", "te", "host", "keep-alive", "transfer-encoding"):
        assert gone not in fields
    assert all(k == k.lower() for k in fields)


async def test_requests_share_one_connection_as_streams(tmp_path: Path) -> None:
    async with serving() as (up, seen), through(tmp_path, up) as (port, _, _):
        results = await asyncio.gather(*(get(port, f"/echo?i={i}") for i in range(20)))
        assert [r[0] for r in results] == [200] * 20
        # a POST body goes in DATA frames, its length kept
        async with aiohttp.ClientSession() as s:
            r = await s.post(f"http://127.0.0.1:{port}/echo", data=b"x" * 100_000)
            assert json.loads(await r.read())["body"] == 100_000
    assert seen.connections == 1
    assert len(seen.streams) == 21


@pytest.mark.parametrize("path", ["/refuse-once", "/goaway-once"])
async def test_a_stream_not_processed_is_retried_even_for_a_post(tmp_path: Path, path: str) -> None:
    """REFUSED_STREAM, and a stream above a GOAWAY's last id, never reached the app (RFC 9113
    section 8.7): retried as a connect failure is, whatever the method."""
    async with (
        serving() as (up, seen),
        through(tmp_path, up) as (port, _, _),
        aiohttp.ClientSession() as s,
    ):
        r = await s.post(f"http://127.0.0.1:{port}{path}", data=b"pay")
        assert r.status == 200
        assert r.headers["x-retry-attempts"] == "2"
        assert json.loads(await r.read())["body"] == 3
    assert seen.paths() == [path, path]


async def test_trailers_reach_an_http2_client(tmp_path: Path) -> None:
    async with serving() as (up, _), through(tmp_path, up) as (port, _, _):
        answer = await asyncio.to_thread(raw_call, port, "/trailers", (b"x",))
    assert dict(answer.headers)[":status"] == "200" and answer.data == b"body"
    assert answer.trailers == [("x-checksum", "1")]


async def test_a_client_that_leaves_resets_its_upstream_stream(tmp_path: Path) -> None:
    async with serving() as (up, seen), through(tmp_path, up) as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"first"), 5)
        assert b" 200 " in head.split(b"\r\n")[0]
        writer.close()
        for _ in range(200):
            if ErrorCodes.CANCEL in seen.resets:
                break
            await asyncio.sleep(0.02)
        assert seen.resets == [ErrorCodes.CANCEL]
        assert seen.open_streams == 0
        # the stream's slot is free: the connection serves the next request
        status, _, _ = await get(port, "/echo")
        assert status == 200
    assert seen.connections == 1


async def test_flow_control_bounds_what_a_slow_client_makes_the_sidecar_hold(
    tmp_path: Path,
) -> None:
    """A 64 MB answer to a client that reads nothing: the sidecar opens the stream's window
    only as it relays, so the upstream stops after the window (256 KiB) and what the
    sockets between take; when the client leaves, the stream is reset."""
    async with serving() as (up, seen), through(tmp_path, up) as (port, _, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /big?n=64000000 HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        before = -1
        for _ in range(10):  # until the upstream can send no more (the sockets filled)
            if seen.sent == before:
                break
            before = seen.sent
            await asyncio.sleep(0.3)
        # About 6.5 MB measured: the window and the loopback sockets' buffers, not 64 MB.
        assert seen.sent < 24_000_000
        writer.close()
        for _ in range(250):
            if seen.open_streams == 0:
                break
            await asyncio.sleep(0.02)
        assert seen.resets == [ErrorCodes.CANCEL]


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_an_upstream_status_is_judged_as_for_http1(tmp_path: Path) -> None:
    async with (
        serving() as (up, _),
        through(tmp_path, up, "    retry: {attempts: 2, backoff: {base: 1ms}}\n") as (port, _, _),
    ):
        status, headers, _ = await get(port, "/status?code=503")
        assert status == 503 and headers["x-retry-attempts"] == "2"
        status, headers, _ = await get(port, "/status?code=404")
        assert status == 404 and headers["x-retry-fate"] == "not-retryable"


NGINX_H2C = """\
  server {{
    listen 127.0.0.1:{port} http2;
    location / {{ add_header X-Proto $server_protocol always; return 200 "nginx $request_method $request_uri\\n"; }}
  }}
"""


async def test_nginx_as_the_h2c_upstream(tmp_path: Path) -> None:
    """The reference h2c server: nginx says it was spoken to in HTTP/2.0."""
    ng_port = free_port()
    root = tmp_path / "ngx"
    root.mkdir()
    nginx = run_nginx(root, NGINX_H2C.format(port=ng_port))
    try:
        await asyncio.to_thread(wait_port, ng_port, nginx, "nginx")
        async with through(tmp_path, ng_port) as (port, _, _):
            status, headers, body = await get(port, "/a?b=c")
        assert status == 200 and headers["x-proto"] == "HTTP/2.0"
        assert body == b"nginx GET /a?b=c\n"
    finally:
        stop(nginx)


__all__ = ["Seen"]


NGINX_TLS = """\
  server {{
    listen 127.0.0.1:{h2} ssl http2;
    ssl_certificate {cert}; ssl_certificate_key {key};
    location / {{ add_header X-Proto $server_protocol always; return 200 "h2 server\\n"; }}
  }}
  server {{
    listen 127.0.0.1:{h1} ssl;
    ssl_certificate {cert}; ssl_certificate_key {key};
    location / {{ add_header X-Proto $server_protocol always; return 200 "h1 server\\n"; }}
  }}
"""


async def test_over_https_h2_is_agreed_by_alpn_and_auto_lets_the_upstream_choose(
    tmp_path: Path,
) -> None:
    """nginx as the reference: ``h2`` to a server that speaks it is HTTP/2.0; ``auto`` is
    HTTP/2.0 where the server offers it and HTTP/1.1 where it does not; ``h2`` to a server
    without it is refused as a TLS handshake failure (never retried, never HTTP/1.1)."""
    root = tmp_path / "ngx"
    root.mkdir(mode=0o755)
    certs = tlscerts.make(root / "certs")
    h2_port, h1_port = free_port(), free_port()
    nginx = run_nginx(
        root,
        NGINX_TLS.format(h2=h2_port, h1=h1_port, cert=certs.server.cert, key=certs.server.key),
    )
    port, admin = free_port(), free_port()
    tls = f"    tls: {{ca_file: {certs.ca}}}\n"
    routes = "".join(
        f"  - name: {name}\n    match: {{path_prefix: /{name}}}\n"
        f"    upstream: https://localhost:{up}\n    upstream_protocol: {proto}\n{tls}"
        for name, up, proto in (
            ("h2h2", h2_port, "h2"),
            ("autoh2", h2_port, "auto"),
            ("autoh1", h1_port, "auto"),
            ("h2h1", h1_port, "h2"),
        )
    )
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n"
        f"routes:\n{routes}"
    )
    try:
        await asyncio.to_thread(wait_port, h2_port, nginx, "nginx")
        proc = await launched(cfg, port, admin)
        try:
            seen = {}
            for name in ("h2h2", "autoh2", "autoh1", "autoh1", "h2h1"):
                status, headers, body = await get(port, f"/{name}")
                seen[name] = (status, headers.get("x-proto") or headers.get("X-Proto"), body)
        finally:
            proc.terminate()
    finally:
        stop(nginx)
    assert seen["h2h2"] == (200, "HTTP/2.0", b"h2 server\n")
    assert seen["autoh2"] == (200, "HTTP/2.0", b"h2 server\n")
    assert seen["autoh1"] == (200, "HTTP/1.1", b"h1 server\n")
    status, _, body = seen["h2h1"]
    assert status == 502 and b"tls" in body.lower()


async def test_requests_cut_at_random_moments_give_back_their_streams_and_slots(
    tmp_path: Path,
) -> None:
    """Clients that leave at random moments (connecting, waiting for the head, mid-body, mid
    upload): every upstream stream is reset or ended, and the route's one bulkhead slot is
    back (the next request is served, not refused)."""
    rng = random.Random(32)
    bulkhead = "    bulkhead: {max_concurrent: 8, queue_timeout: 0s}\n"
    async with serving() as (up, seen), through(tmp_path, up, bulkhead) as (port, _, _):

        async def one(i: int) -> None:
            path = rng.choice(["/hold", "/big?n=3000000", "/echo"])
            method = b"POST" if path == "/echo" else b"GET"
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"%s %s HTTP/1.1\r\nHost: x\r\n" % (method, path.encode())
            if method == b"POST":
                head += b"Content-Length: 2000000\r\n"
            writer.write(head + b"\r\n")
            if method == b"POST":
                writer.write(b"u" * rng.randrange(0, 1_500_000))
            await asyncio.sleep(rng.uniform(0, 0.05))
            writer.transport.abort()

        for _ in range(3):
            await asyncio.gather(*(one(i) for i in range(8)))
        for _ in range(250):
            if seen.open_streams == 0:
                break
            await asyncio.sleep(0.02)
        assert seen.open_streams == 0
        results = await asyncio.gather(*(get(port, "/echo") for _ in range(8)))
        assert [r[0] for r in results] == [200] * 8


async def test_an_upstream_that_allows_one_stream_gets_one_per_connection(tmp_path: Path) -> None:
    """Its SETTINGS are waited for before the first stream: a burst is spread over new
    connections, never refused by it."""
    async with serving(max_streams=1) as (up, seen), through(tmp_path, up) as (port, _, _):
        results = await asyncio.gather(*(get(port, "/echo") for _ in range(6)))
        assert [(r[0], r[1]["x-retry-attempts"]) for r in results] == [(200, "1")] * 6
    assert seen.resets == [] and len(seen.streams) == 6
    assert 1 <= seen.connections <= 6

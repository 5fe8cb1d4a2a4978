"""Methods the C parser does not know (RFC 9110 section 9.1: a method is any token): forwarded
as nginx forwards them, never retried once sent, never hedged.

The differential part puts nginx in the sidecar's place: httpbin under gunicorn behind nginx
(``proxy_pass``) and behind the real sidecar process, the same raw bytes or the same real
client (http.client) to each, the answers compared as tests/difftools.py compares them.
"""

from __future__ import annotations

import asyncio
import http.client
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from sidecar.config.model import RetryPolicy
from sidecar.proxy.framing import escape_request_line
from sidecar.proxy.methods import PARSER_METHODS, stand_in
from sidecar.proxy.server import GuardedRequestHandler, SidecarServer
from sidecar.retry.classify import may_resend
from tests import difftools as d
from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port
from tests.rawhttp import raw_request, raw_server, read_head
from tests.wait import until

NGINX_PROXY_CONF = """\
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass http://127.0.0.1:{upstream};
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_pass_header Server;
    }}
  }}
"""

# (name, request bytes with {host}, the methods of the responses expected)
RAW = [
    ("foo", b"FOO /anything HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n", ["FOO"]),
    (
        "brew-with-body",
        b"BREW /anything/pot HTTP/1.1\r\nHost: {host}\r\nContent-Length: 6\r\n"
        b"Connection: close\r\n\r\ncoffee",
        ["BREW"],
    ),
    (
        "pipelined-get-foo-brew",
        b"GET /bytes/8?seed=1 HTTP/1.1\r\nHost: {host}\r\n\r\n"
        b"FOO /get HTTP/1.1\r\nHost: {host}\r\n\r\n"
        b"BREW /status/200 HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        ["GET", "FOO", "BREW"],
    ),
]


@pytest.fixture(scope="module")
def sites() -> Iterator[tuple[int, int]]:
    """(nginx proxy port, sidecar port), both in front of one httpbin."""
    if shutil.which("nginx") is None:
        pytest.skip("nginx is not installed: it is the reference proxy here")
    pytest.importorskip(
        "httpbin", reason="httpbin is not installed (see README: it goes in with --no-deps)"
    )
    tmp = d.make_tmp()
    bin_port, ngx_port, port, admin = (free_port() for _ in range(4))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        procs.append(d.start_gunicorn(bin_port))
        conf = NGINX_PROXY_CONF.format(port=ngx_port, upstream=bin_port)
        procs.append(d.run_nginx(tmp, conf, connections=64))
        d.wait_http(ngx_port, "/status/200", procs[-1], "nginx")
        cfg = tmp / "sidecar.yaml"
        cfg.write_text(
            f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n"
            f"routes:\n  - name: bin\n    upstream: http://127.0.0.1:{bin_port}\n"
        )
        procs.append(d.start_sidecar(cfg, port))
        yield ngx_port, port
    finally:
        for p in reversed(procs):
            d.stop(p)
        shutil.rmtree(tmp, ignore_errors=True)


def _compare(reply: d.Reply, method: str, port: int) -> dict[str, object]:
    """As the differential suite compares, but header order aside: nginx writes its Server
    and Date first, whatever the order the upstream sent."""
    seen = d.comparable(reply, d.Case(method, method, "/"), f"127.0.0.1:{port}")
    seen["headers"] = sorted(seen["headers"])
    return seen


@pytest.mark.parametrize(("name", "data", "methods"), RAW, ids=[c[0] for c in RAW])
def test_an_unknown_method_gets_what_nginx_in_the_sidecars_place_gets(
    sites: tuple[int, int], name: str, data: bytes, methods: list[str]
) -> None:
    answers = []
    for port in sites:
        raw = d.raw_exchange(port, data.replace(b"{host}", b"127.0.0.1:%d" % port))
        answers.append(
            [
                _compare(r, m, port)
                for r, m in zip(d.parse_responses(raw, methods), methods, strict=True)
            ]
        )
    via_nginx, via_sidecar = answers
    assert [a["status"] for a in via_nginx] == [200 if m == "GET" else 405 for m in methods]
    assert via_sidecar == via_nginx


def test_a_kept_alive_client_sends_an_unknown_method_after_other_requests(
    sites: tuple[int, int],
) -> None:
    """http.client on one connection: GET, a POST with a body, then BREW and FOO."""
    answers = []
    for port in sites:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        got = []
        try:
            for method, path, body in (
                ("GET", "/get", None),
                ("BREW", "/anything", b"x"),
                ("POST", "/status/201", b"abc"),
                ("FOO", "/get", None),
            ):
                conn.request(method, path, body=body)
                resp = conn.getresponse()
                resp.read()
                got.append((resp.status, resp.getheader("Allow")))
        finally:
            conn.close()
        answers.append(got)
    assert answers[0][1][0] == 405 and answers[0][3][0] == 405
    assert answers[1] == answers[0]


def test_the_parser_knows_exactly_the_methods_the_stand_in_leaves_alone() -> None:
    """PARSER_METHODS is what the installed llhttp accepts: a method it also knew would only
    cost a stand-in; one it did not know, left alone, would get 400."""
    from aiohttp._http_parser import HttpRequestParser  # type: ignore[import-not-found]

    loop = asyncio.new_event_loop()
    try:
        for method in [*PARSER_METHODS, "FOO", "BREW", "get", "X-Y.Z~1"]:
            parser = HttpRequestParser(object(), loop, 2**16)
            try:
                parser.feed_data(f"{method} / HTTP/1.1\r\nHost: a\r\n\r\n".encode())
                known = True
            except Exception:
                known = False
            assert known == (method in PARSER_METHODS), method
            assert (stand_in(f"{method} / HTTP/1.1\r\n".encode())[1] is None) == known
    finally:
        loop.close()


def test_only_a_method_token_at_the_start_is_stood_in_for() -> None:
    assert stand_in(b"BREW /pot HTTP/1.1\r\n") == (b"GET /pot HTTP/1.1\r\n", "BREW")
    assert stand_in(b"GET / HTTP/1.1\r\n") == (b"GET / HTTP/1.1\r\n", None)
    for data in (b"BR", b"B(REW / HTTP/1.1\r\n", b" / HTTP/1.1", b"CONNECT a:1 HTTP/1.1\r\n"):
        assert stand_in(data) == (data, None)


def test_unknown_methods_are_never_resent_once_sent_whatever_the_policy() -> None:
    for mode in ("never", "with-idempotency-key", "always"):
        policy = RetryPolicy(non_idempotent=mode)  # type: ignore[arg-type]
        assert not may_resend(policy, "BREW", True)
        assert not may_resend(policy, "LOCK", True)
    assert may_resend(RetryPolicy(non_idempotent="always"), "POST", False)


async def test_an_unknown_method_is_sent_once_even_with_a_key_and_its_503_relayed(
    tmp_path: Path,
) -> None:
    """The real process, an upstream answering 503: POST with a key would be retried under
    ``non_idempotent: always``; BREW is sent once and its 503 relayed as it came."""
    seen: list[bytes] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await read_head(r)
        seen.append(head.split(b" ", 1)[0])
        w.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\nbusy")
        await w.drain()

    async with raw_server(upstream) as up:
        port, admin = free_port(), free_port()
        cfg = tmp_path / "c.yaml"
        cfg.write_text(
            f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n"
            "defaults: {retry: {non_idempotent: always, backoff: {base: 1ms, max: 2ms}}}\n"
            f"routes:\n  - name: r\n    upstream: http://127.0.0.1:{up}\n"
        )
        proc = SidecarProcess(cfg)
        proc.start()
        try:
            await proc.wait_port(port)
            req = b"%s /x HTTP/1.1\r\nHost: a\r\nIdempotency-Key: k1\r\nConnection: close\r\n\r\n"
            brew = await raw_request(port, req % b"BREW")
            assert brew.startswith(b"HTTP/1.1 503 ")
            assert b"x-retry-attempts: 1\r\n" in brew and brew.endswith(b"busy")
            assert seen == [b"BREW"]
            post = await raw_request(port, req % b"POST")
            assert b"x-retry-attempts: 3\r\n" in post  # the same policy does retry a POST
        finally:
            proc.terminate()


async def test_nothing_inside_a_request_is_taken_for_a_method() -> None:
    """A read that starts with ``token SP`` is a request line only at a request boundary: a
    request line split inside its target, and a body that starts like a request line, arrive
    as sent (the guarded server, on a real socket, each piece read before the next is sent)."""
    got: list[tuple[str, str, bytes]] = []
    entered = asyncio.Event()

    async def handler(request: web.BaseRequest) -> web.StreamResponse:
        entered.set()
        got.append((request.method, request.raw_path, await request.read()))
        return web.Response(body=b"ok")

    server = SidecarServer(handler, header_timeout=lambda: 30.0, on_malformed=lambda _: None)
    listener = await asyncio.get_running_loop().create_server(server, "127.0.0.1", 0)
    port = listener.sockets[0].getsockname()[1]
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(b"GET /very")
        await until(
            lambda: any(
                isinstance(c, GuardedRequestHandler) and c._head_timer for c in server.connections
            ),
            "the first piece of the head read",
        )
        w.write(b"long HTTP/1.1\r\nHost: a\r\n\r\n")
        await r.readuntil(b"ok")
        w.write(b"POST /up HTTP/1.1\r\nHost: a\r\nContent-Length: 12\r\n\r\n")
        entered.clear()
        await until(entered.is_set, "the POST handled")
        w.write(b"BREW / HTTP/")
        await r.readuntil(b"ok")
        w.write(b"BREW /pot HTTP/1.1\r\nHost: a\r\n\r\n")
        await r.readuntil(b"ok")
    finally:
        w.close()
        listener.close()
        await listener.wait_closed()
    assert got == [
        ("GET", "/verylong", b""),
        ("POST", "/up", b"BREW / HTTP/"),
        ("BREW", "/pot", b""),
    ]


# -- a method with bytes over 0x7F is no token ---------------------------------------------------


async def test_a_method_with_bytes_over_0x7f_is_refused_not_rewritten(
    upstream_factory, sidecar_factory
):
    """``G\\xc3\\x89T`` is no token (RFC 9110 section 9.1): 400, nothing upstream. The escape
    meant for raw bytes in the target made it ``G%C3%89T``, a valid token, and forwarded it."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    out = await raw_request(
        sc.sidecar.proxy_port, b"G\xc3\x89T /x HTTP/1.1\r\nHost: t\r\n\r\n", timeout=5
    )
    assert out.split(b"\r\n", 1)[0].split(b" ")[1] == b"400", out[:200]
    assert up.seen == []
    # The target's bytes over 0x7F are still escaped for the parser, the method's never,
    # whichever read the line's first space comes in.
    assert escape_request_line(b"G\xc3\x89T /\xc3\xbc HTTP/1.1\r\n", b"")[0] == (
        b"G\xc3\x89T /%C3%BC HTTP/1.1\r\n"
    )
    assert escape_request_line(b"T /\xc3\xbc", b"G\xc3\x89")[0] == b"T /%C3%BC"
    assert escape_request_line(b"\xc3\xbc HTTP/1.1\r\n", b"GET /")[0] == b"%C3%BC HTTP/1.1\r\n"

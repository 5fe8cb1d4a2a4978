"""The differential transparency suite: every case is sent direct to a real application and
through the real sidecar process, with the same real client, and the answers must match.

Upstreams: httpbin (PyPI) under gunicorn; nginx serving files and fixed answers (skipped, saying
so, when nginx is not installed). Clients: curl (skipped when absent), requests, httpx, urllib3,
aiohttp, and raw sockets for exact bytes (HTTP/1.0, pipelining, odd targets, Connection: close).
What is compared, and the documented differences left out, are in tests/difftools.py.

One gunicorn, one nginx and one sidecar process serve the whole module.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import sqlite3
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests import difftools as d
from tests.difftools import Case

MULTIPART_BOUNDARY = "diffboundary7MA4YWxkTrZu0gW"


def _multipart() -> bytes:
    from urllib3.filepost import encode_multipart_formdata

    body, _ = encode_multipart_formdata(
        {
            "field": "value",
            "unicode": "grüße",
            "file": ("report.csv", b"a,b\n1,2\n", "text/csv"),
            "blob": ("blob.bin", bytes(range(256)), "application/octet-stream"),
        },
        boundary=MULTIPART_BOUNDARY,
    )
    return body


JSON_BODY = b'{"name": "gr\\u00fc\\u00dfe", "items": [1, 2, 3], "nested": {"ok": true}}'
FORM_BODY = urllib.parse.urlencode({"a": "1", "b": "two words", "c": "ü&="}).encode()
BIG = bytes(range(251)) * (5 * 1024 * 1024 // 251)  # ~5 MiB, not a multiple of the chunk size
MIB = bytes(range(256)) * 4096
CT_JSON = (("Content-Type", "application/json"),)
CT_FORM = (("Content-Type", "application/x-www-form-urlencoded"),)
NO_HTTPX_LATIN1 = ("curl", "requests", "urllib3", "aiohttp")

BIN_CASES = [
    # methods and echoed requests
    Case("get", "GET", "/get", echo=True),
    Case("get-query", "GET", "/get?a=1&b=%20x&b=2&empty=&flag", echo=True),
    Case("put", "PUT", "/anything/put", body=b"put body", echo=True),
    Case("patch", "PATCH", "/anything/patch", body=b"patch", echo=True),
    Case("delete", "DELETE", "/anything/thing/1", echo=True),
    Case("options", "OPTIONS", "/anything/opts", echo=True),
    Case("head-get", "HEAD", "/get", echo=True),
    Case("head-bytes", "HEAD", "/bytes/64?seed=2"),
    Case("custom-headers", "GET", "/headers", (("X-Trace", "abc"), ("X-Empty", "")), echo=True),
    Case(
        "latin1-header",
        "GET",
        "/headers",
        (("X-Name", "café"),),
        echo=True,
        clients=NO_HTTPX_LATIN1,
    ),
    # bodies
    Case("json", "POST", "/post", CT_JSON, JSON_BODY, echo=True),
    Case("form", "POST", "/post", CT_FORM, FORM_BODY, echo=True),
    Case(
        "multipart",
        "POST",
        "/post",
        (("Content-Type", f"multipart/form-data; boundary={MULTIPART_BOUNDARY}"),),
        _multipart(),
        echo=True,
    ),
    Case("chunked-small", "POST", "/anything/chunked", body=b"x" * 5000, chunked=True, echo=True),
    Case("empty-post", "POST", "/post", body=b"", echo=True),
    Case("upload-5mib", "POST", "/anything/big", body=BIG, echo=True),
    Case(
        "upload-1mib-chunked",
        "PUT",
        "/anything/bigchunked",
        body=MIB,
        chunked=True,
        echo=True,
        clients=("requests", "httpx", "aiohttp"),
    ),
    # response bodies and framing
    Case("bytes", "GET", "/bytes/2048?seed=7"),
    Case("stream-bytes", "GET", "/stream-bytes/8192?seed=3&chunk_size=512"),
    Case("stream-json", "GET", "/stream/4", echo=True),
    Case("base64", "GET", "/base64/SFRUUEJJTiBpcyBhd2Vzb21l"),
    Case("html", "GET", "/html"),
    Case("xml", "GET", "/xml"),
    Case("utf8", "GET", "/encoding/utf8"),
    Case("png", "GET", "/image/png"),
    Case("robots", "GET", "/robots.txt"),
    Case("links", "GET", "/links/4/2"),
    # compression passes through (no decompression, header kept)
    Case("gzip", "GET", "/gzip", echo=True),
    Case("deflate", "GET", "/deflate", echo=True),
    Case("brotli", "GET", "/brotli", echo=True),
    # ranges
    Case("range", "GET", "/range/2048", (("Range", "bytes=10-99"),), status=206),
    Case("range-suffix", "GET", "/range/2048", (("Range", "bytes=-100"),), status=206),
    Case("range-unsatisfiable", "GET", "/range/100", (("Range", "bytes=500-600"),), status=416),
    # redirects (not followed: the 3xx itself is compared)
    Case("redirect-to", "GET", "/redirect-to?url=%2Fget&status_code=307", status=307),
    Case("relative-redirect", "GET", "/relative-redirect/2", status=302),
    Case(
        "absolute-redirect", "GET", "/absolute-redirect/1", echo=True, status=302
    ),  # body names the host
    Case("redirect-external", "GET", "/redirect-to?url=http%3A%2F%2Fexample.test%2F", status=302),
    # several Set-Cookie, duplicate and non-ASCII response headers
    Case("cookies-set", "GET", "/cookies/set?a=1&b=2&c=three", status=302),
    Case("cookies-echo", "GET", "/cookies", (("Cookie", "a=1; b=2"),), echo=True),
    Case("dup-response-headers", "GET", "/response-headers?X-Dup=1&X-Dup=2&X-Dup=3"),
    Case("latin1-response-header", "GET", "/response-headers?X-Name=%C3%BC"),
    Case(
        "content-disposition",
        "GET",
        "/response-headers?Content-Disposition=attachment%3B%20filename%3D%22%C3%BC.txt%22",
    ),
    # statuses: 204, 304, 4xx, 5xx not in retry_on
    Case("204", "GET", "/status/204", status=204),
    Case("418", "GET", "/status/418", status=418),
    Case("401-auth", "GET", "/basic-auth/user/pass", status=401),
    Case("200-auth", "GET", "/basic-auth/user/pass", (("Authorization", "Basic dXNlcjpwYXNz"),)),
    Case("500", "GET", "/status/500", status=500),
    Case("etag-304", "GET", "/etag/abc", (("If-None-Match", '"abc"'),), status=304),
    Case(
        "cache-304",
        "GET",
        "/cache",
        (("If-Modified-Since", "Sat, 01 Jan 2000 00:00:00 GMT"),),
        status=304,
    ),
    Case("etag-200", "GET", "/etag/abc", (("If-None-Match", '"other"'),), echo=True),
    # streams with pauses longer than the drip route's 200 ms per-try timeout
    Case("drip-pauses", "GET", "/drip?duration=0.6&numbytes=3&delay=0&code=200"),
    # odd but legal targets, forwarded byte for byte
    Case("encoded-slash", "GET", "/anything/a%2Fb%3Fc", echo=True),
    Case("tilde", "GET", "/anything/~user/%7Eother", echo=True),
    Case("params", "GET", "/anything/a;p=1;q=2/b", echo=True),
    Case("double-slash", "GET", "/anything//x//y", echo=True, status=308),  # werkzeug merges
    Case("sub-delims", "GET", "/anything/a:b@c!$&'()*+,;=", echo=True),
    Case("utf8-path", "GET", "/anything/caf%C3%A9?q=%E2%9C%93", echo=True),
    Case("long-query", "GET", "/anything?x=" + "y" * 4000, echo=True),
]

NGX_CASES = [
    Case("ngx-small", "GET", "/ngx/files/small.txt", upstream="ngx"),
    Case("ngx-head", "HEAD", "/ngx/files/small.txt", upstream="ngx"),
    Case("ngx-5mib", "GET", "/ngx/files/big.bin", upstream="ngx"),
    Case(
        "ngx-range",
        "GET",
        "/ngx/files/big.bin",
        (("Range", "bytes=100-199"),),
        upstream="ngx",
        status=206,
    ),
    Case(
        "ngx-multirange",
        "GET",
        "/ngx/files/small.txt",
        (("Range", "bytes=0-1,-2"),),
        upstream="ngx",
        status=206,
    ),
    Case(
        "ngx-304",
        "GET",
        "/ngx/files/small.txt",
        (("If-Modified-Since", "Fri, 01 Jan 2100 00:00:00 GMT"),),
        upstream="ngx",
        status=304,
    ),
    Case("ngx-gzip", "GET", "/ngx/gz/text.txt", (("Accept-Encoding", "gzip"),), upstream="ngx"),
    Case("ngx-cookies", "GET", "/ngx/cookies", upstream="ngx"),
    Case("ngx-dup", "GET", "/ngx/dup", upstream="ngx"),
    Case("ngx-204", "GET", "/ngx/nocontent", upstream="ngx", status=204),
    Case("ngx-301", "GET", "/ngx/moved", upstream="ngx", status=301),
    Case("ngx-302-external", "GET", "/ngx/found", upstream="ngx", status=302),
    Case("ngx-dir-redirect", "GET", "/ngx/files", upstream="ngx", status=301),
    Case("ngx-418", "GET", "/ngx/teapot", upstream="ngx", status=418),
    Case("ngx-404", "GET", "/ngx/missing", upstream="ngx", status=404),
    Case("ngx-utf8-name", "GET", "/ngx/files/utf8-%C3%BC.txt", upstream="ngx"),
    Case("ngx-index", "GET", "/ngx/", upstream="ngx"),
    Case("ngx-post-405", "POST", "/ngx/files/small.txt", body=b"x", upstream="ngx", status=405),
]

CLIENT_CASES = [(client, case) for case in BIN_CASES + NGX_CASES for client in case.clients]

# Exact bytes: (name, request bytes with {host}, the methods of the responses expected).
RAW_CASES = [
    ("http10", b"GET /bytes/100?seed=1 HTTP/1.0\r\nHost: {host}\r\n\r\n", ["GET"]),
    (
        "http10-keepalive-stream",
        b"GET /stream-bytes/3000?seed=5 HTTP/1.0\r\nHost: {host}\r\nConnection: keep-alive\r\n"
        b"\r\nGET /bytes/10?seed=5 HTTP/1.0\r\nHost: {host}\r\n\r\n",
        ["GET"],
    ),
    (
        "http10-post",
        b"POST /anything HTTP/1.0\r\nHost: {host}\r\nContent-Length: 5\r\n\r\nhello",
        ["POST"],
    ),
    (
        "pipelined-three",
        b"GET /bytes/16?seed=1 HTTP/1.1\r\nHost: {host}\r\n\r\n"
        b"GET /status/204 HTTP/1.1\r\nHost: {host}\r\n\r\n"
        b"GET /stream-bytes/700?seed=2&chunk_size=100 HTTP/1.1\r\nHost: {host}\r\n"
        b"Connection: close\r\n\r\n",
        ["GET", "GET", "GET"],
    ),
    (
        "pipelined-head-get",
        b"HEAD /bytes/16?seed=1 HTTP/1.1\r\nHost: {host}\r\n\r\n"
        b"GET /bytes/16?seed=1 HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        ["HEAD", "GET"],
    ),
    (
        "pipelined-post-get",
        b"POST /anything HTTP/1.1\r\nHost: {host}\r\nContent-Length: 3\r\n\r\nabc"
        b"GET /bytes/8?seed=9 HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        ["POST", "GET"],
    ),
    (
        "connection-close",
        b"GET /bytes/32?seed=4 HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        ["GET"],
    ),
    (
        "chunked-request",
        b"POST /anything HTTP/1.1\r\nHost: {host}\r\nTransfer-Encoding: chunked\r\n"
        b"Connection: close\r\n\r\n3\r\nabc\r\n4;ext=1\r\ndefg\r\n0\r\n\r\n",
        ["POST"],
    ),
    (
        "duplicate-request-headers",
        b"GET /headers HTTP/1.1\r\nHost: {host}\r\nX-Dup: 1\r\nX-Dup: 2\r\n"
        b"Connection: close\r\n\r\n",
        ["GET"],
    ),
    (
        "obs-text-request-header",
        b"GET /headers HTTP/1.1\r\nHost: {host}\r\nX-Raw: caf\xe9\r\nConnection: close\r\n\r\n",
        ["GET"],
    ),
    (
        "odd-target-raw",
        b"GET /anything/%2e%2E/a%00b/%ZZ?x=%&y HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        ["GET"],
    ),
    (
        "dot-segments",
        b"GET /anything/a/./b/../c HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n",
        ["GET"],
    ),
    (
        "header-case-and-spaces",
        b"GET /headers HTTP/1.1\r\nhOsT: {host}\r\nx-lower:   padded value   \r\n"
        b"Connection: close\r\n\r\n",
        ["GET"],
    ),
]

RAW_ECHO = {
    "http10-post",
    "pipelined-post-get",
    "chunked-request",
    "duplicate-request-headers",
    "obs-text-request-header",
    "odd-target-raw",
    "dot-segments",
    "header-case-and-spaces",
}


@pytest.fixture(scope="module")
def world() -> Iterator[d.World]:
    pytest.importorskip(
        "httpbin",
        reason="httpbin is not installed: pip install --no-deps 'httpbin>=0.10.2,<0.11' "
        "(see README: its greenlet pin conflicts with Playwright's)",
    )
    tmp = d.make_tmp()
    procs = []
    try:
        bin_port = d.free_port()
        procs.append(d.start_gunicorn(bin_port))
        ngx_port: int | None = None
        if d.nginx_available():
            ngx_port = d.free_port()
            procs.append(d.start_nginx(ngx_port, tmp / "nginx"))
        port, admin = d.free_port(), d.free_port()
        config = tmp / "sidecar.yaml"
        config.write_text(d.sidecar_config(port, admin, bin_port, ngx_port or d.free_port()))
        procs.append(d.start_sidecar(config, port))
        yield d.World(bin_port, ngx_port, port, tmp)
    finally:
        d.close_clients()
        for p in reversed(procs):
            d.stop(p)


def _direct_port(world: d.World, case: Case) -> int:
    if case.upstream == "ngx":
        if world.ngx_port is None:
            pytest.skip("nginx is not installed: the nginx upstream cases need it")
        return world.ngx_port
    return world.bin_port


def _check(direct: d.Reply, proxied: d.Reply, case: Case, dport: int, pport: int) -> None:
    # The proxied answer really went through the sidecar, and the direct one did not.
    assert proxied.header(b"x-retry-fate") is not None, proxied.headers
    assert direct.header(b"x-retry-fate") is None
    assert direct.status == case.status, (direct.status, direct.body[:200])
    want = d.comparable(direct, case, f"127.0.0.1:{dport}")
    got = d.comparable(proxied, case, f"127.0.0.1:{pport}")
    extra = [h for h in got["headers"] if h not in want["headers"]] if "headers" in got else []
    assert got == want, extra


@pytest.mark.slow
@pytest.mark.parametrize(
    ("client", "case"), CLIENT_CASES, ids=[f"{cl}-{c.name}" for cl, c in CLIENT_CASES]
)
def test_same_answer_direct_and_through_the_sidecar(world: d.World, client: str, case: Case):
    if client == "curl" and not d.curl_available():
        pytest.skip("curl is not installed")
    dport = _direct_port(world, case)
    tmp = world.tmp
    direct = d.send(client, f"http://127.0.0.1:{dport}", case, tmp)
    proxied = d.send(client, f"http://127.0.0.1:{world.sidecar_port}", case, tmp)
    _check(direct, proxied, case, dport, world.sidecar_port)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "data", "methods"), RAW_CASES, ids=[c[0] for c in RAW_CASES])
def test_same_bytes_direct_and_through_the_sidecar(world: d.World, name, data, methods):
    case = Case(name, methods[-1], "", echo=name in RAW_ECHO)
    answers = []
    for port in (world.bin_port, world.sidecar_port):
        raw = d.raw_exchange(port, data.replace(b"{host}", b"127.0.0.1:%d" % port))
        answers.append(d.parse_responses(raw, list(methods)))
    direct, proxied = answers
    assert len(direct) == len(proxied) == len(methods)
    for dr, pr, method in zip(direct, proxied, methods, strict=True):
        one = Case(name, method, "", echo=case.echo, status=dr.status)
        assert dr.status in (200, 204), dr.body[:200]
        _check(dr, pr, one, world.bin_port, world.sidecar_port)


@pytest.mark.slow
def test_the_comparison_sees_a_difference(world: d.World):
    """The suite cannot pass by comparing nothing: a changed header or body byte is seen."""
    case = Case("self-check", "GET", "/response-headers?X-A=1")
    one = d.send("requests", f"http://127.0.0.1:{world.bin_port}", case, world.tmp)
    other = d.send(
        "requests",
        f"http://127.0.0.1:{world.bin_port}",
        Case("self-check", "GET", "/response-headers?X-A=2"),
        world.tmp,
    )
    here = f"127.0.0.1:{world.bin_port}"
    assert d.comparable(one, case, here) != d.comparable(other, case, here)
    tampered = d.Reply(one.status, one.headers, one.body + b" ")
    assert d.comparable(one, case, here) != d.comparable(tampered, case, here)


def test_case_count_meets_the_floor():
    assert len(CLIENT_CASES) + len(RAW_CASES) >= 150


# -- the request side: what reaches the upstream, sidecar against nginx ------------------------
#
# nginx stands in the sidecar's place in front of the same recording upstream; each upload is
# sent to both split at byte boundaries (one byte at a time, random cuts, whole, or the head
# with the first body bytes in one read and the rest after), over
# HTTP/1.1 keep-alive (a second request follows on the connection), HTTP/1.1 with
# ``Connection: close`` and HTTP/1.0 (bytes after the request follow in the same stream:
# neither may forward them), with Content-Length or chunked bodies from 1 KiB to 10 MiB, each
# side of retry.max_body_bytes (64 KiB: buffered up to it, streamed beyond). What the upstream
# received (method, target, end-to-end headers, body bytes) and the statuses must be equal.

KIB = 1024
UPLOAD_SIZES = {"1k": KIB, "64k": 64 * KIB, "64k+1": 64 * KIB + 1, "1m": KIB * KIB}
UPLOAD_VARIANTS = ("keepalive", "close", "http10")
UPLOAD_SPLITS = ("bytewise", "random", "whole", "head-and-some")
AFTER_CLOSE = b"GET /after-close HTTP/1.1\r\nHost: up.test\r\n\r\n"
NEXT = b"GET /next HTTP/1.1\r\nHost: up.test\r\nConnection: close\r\n\r\n"


@dataclass(frozen=True)
class Upload:
    variant: str
    chunked: bool
    size: int
    split: str

    @property
    def name(self) -> str:
        framing = "chunked" if self.chunked else "length"
        return f"{self.variant}-{framing}-{self.size}-{self.split}"


def _upload_cases() -> list[Upload]:
    cases = []
    for variant in UPLOAD_VARIANTS:
        for chunked in (False, True):
            if chunked and variant == "http10":
                continue  # refused (RFC 9112 section 6.1): its own test
            for label, size in UPLOAD_SIZES.items():
                for split in UPLOAD_SPLITS:
                    if label == "64k" and split != "random":
                        continue
                    cases.append(Upload(variant, chunked, size, split))
            cases.append(Upload(variant, chunked, 10 * KIB * KIB, "random"))
    return cases


UPLOAD_CASES = _upload_cases()


def _body(size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    # Blank lines and chunk-like text inside the body, so no cut point is only ever a head's.
    return (b"\r\n\r\n0\r\n\r\nPOST / HTTP/1.1\r\n" + rng.randbytes(size))[:size]


def _upload_bytes(case: Upload, body: bytes) -> tuple[bytes, int]:
    """The request bytes (the bytes that follow it included) and the length of its head."""
    version = b"HTTP/1.0" if case.variant == "http10" else b"HTTP/1.1"
    head = b"PUT /up/%s?q=1 %s\r\nHost: up.test\r\nX-Case: %s\r\n" % (
        case.name.encode(),
        version,
        case.name.encode(),
    )
    if case.variant == "close":
        head += b"Connection: close\r\n"
    if case.chunked:
        head += b"Transfer-Encoding: chunked\r\n\r\n"
        rng = random.Random(len(body))
        framed, i = b"", 0
        while i < len(body):
            n = rng.randrange(1, 200_000)
            framed += b"%x\r\n%b\r\n" % (len(body[i : i + n]), body[i : i + n])
            i += n
        framed += b"0\r\n\r\n"
    else:
        head += b"Content-Length: %d\r\n\r\n" % len(body)
        framed = body
    after = NEXT if case.variant == "keepalive" else AFTER_CLOSE
    return head + framed + after, len(head)


def _pieces(data: bytes, head_len: int, split: str, rng: random.Random) -> list[bytes]:
    if split == "whole":
        return [data]
    if split == "head-and-some":  # the head with the first body bytes in one read, then more
        n = head_len + 100
        return [data[:n]] + [data[i : i + 65536] for i in range(n, len(data), 65536)]
    if split == "bytewise":  # the head and the first body bytes one at a time
        n = min(len(data), head_len + 64)
        rest = data[n:]
        return [data[i : i + 1] for i in range(n)] + [
            rest[i : i + 65536] for i in range(0, len(rest), 65536)
        ]
    cuts = sorted(rng.sample(range(1, len(data)), min(12, len(data) - 1)))
    cuts += [head_len + 1, head_len - 1]  # around the end of the head too
    edges = sorted({0, len(data), *cuts})
    return [data[a:b] for a, b in itertools.pairwise(edges)]


@dataclass
class UploadWorld:
    upstream: d.RecordingUpstream
    nginx_port: int
    sidecar_port: int
    tmp: Path


@pytest.fixture(scope="module")
def upload_world() -> Iterator[UploadWorld]:
    if not d.nginx_available():
        pytest.skip("nginx is not installed: the request-side comparison needs it as reference")
    tmp = d.make_tmp()
    up = d.RecordingUpstream()
    procs = []
    try:
        ngx = d.free_port()
        procs.append(d.start_nginx_proxy(ngx, up.port, up.raw_port, tmp / "nginx-proxy"))
        port, admin = d.free_port(), d.free_port()
        config = tmp / "uploads.yaml"
        config.write_text(
            f"""
version: 1
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
limits: {{max_request_body: 16MiB, body_idle_timeout: 20s}}
defaults:
  breaker: {{min_sequences: 1000000}}
dlq: {{path: "{tmp / "dlq.sqlite3"}"}}
routes:
  - name: dlq
    match: {{path_prefix: /dlq/}}
    upstream: "http://127.0.0.1:{up.port}"
    retry: {{attempts: 1}}
    dlq: {{enabled: true}}
  - name: raw
    match: {{path_prefix: /raw/}}
    upstream: "http://127.0.0.1:{up.raw_port}"
  - name: up
    upstream: "http://127.0.0.1:{up.port}"
"""
        )
        procs.append(d.start_sidecar(config, port))
        yield UploadWorld(up, ngx, port, tmp)
    finally:
        for p in reversed(procs):
            d.stop(p)
        up.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", UPLOAD_CASES, ids=[c.name for c in UPLOAD_CASES])
def test_the_upstream_receives_what_nginx_would_send_it(upload_world: UploadWorld, case: Upload):
    body = _body(case.size, case.size)
    data, head_len = _upload_bytes(case, body)
    methods = ["PUT", "GET"] if case.variant == "keepalive" else ["PUT"]
    results = []
    for port in (upload_world.nginx_port, upload_world.sidecar_port):
        pieces = _pieces(data, head_len, case.split, random.Random(case.name))
        raw = d.send_in_pieces(port, pieces)
        statuses = [r.status for r in d.parse_responses(raw, methods)]
        results.append((statuses, [d.received_comparable(g) for g in upload_world.upstream.take()]))
    (ngx_status, ngx_seen), (sc_status, sc_seen) = results
    assert ngx_status == [200] * len(methods), ngx_status  # the reference did what it should
    assert ngx_seen[0]["size"] == case.size and ngx_seen[0]["method"] == "PUT"
    assert sc_status == ngx_status
    assert sc_seen == ngx_seen


@pytest.mark.slow
def test_http10_with_transfer_encoding_is_refused_and_the_connection_closed(
    upload_world: UploadWorld,
):
    """RFC 9112 section 6.1: Transfer-Encoding in HTTP/1.0 is faulty framing; nginx answers
    400 and closes. The request after it on the same connection is never processed."""
    data = (
        b"POST /up/te10 HTTP/1.0\r\nHost: up.test\r\nConnection: keep-alive\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n" + NEXT
    )
    for port in (upload_world.nginx_port, upload_world.sidecar_port):
        raw = d.send_in_pieces(port, [data])
        replies = d.parse_responses(raw, ["POST", "GET"])
        assert [r.status for r in replies] == [400], (port, raw[:300])
        assert upload_world.upstream.take() == []


RAW_TARGETS = [b"/raw/f?y=\xc3\xbc", b"/raw/caf\xc3\xa9/\xe2\x9c\x93?q=\xff&r=%C3%BC"]


@pytest.mark.slow
@pytest.mark.parametrize("split", UPLOAD_SPLITS)
@pytest.mark.parametrize("target", RAW_TARGETS, ids=["utf8-query", "utf8-path-and-latin1"])
def test_raw_non_ascii_bytes_in_the_target_are_forwarded_as_sent(
    upload_world: UploadWorld, target: bytes, split: str
):
    """``curl 'http://host/f?y=ü'`` sends the ü as raw UTF-8: nginx and gunicorn accept it and
    pass the bytes on; so does the sidecar, unchanged (never re-encoded), at any split."""
    data = (
        b"GET "
        + target
        + b" HTTP/1.1\r\nHost: up.test\r\n\r\n"
        + NEXT.replace(b"/next", b"/raw/next")
    )
    results = []
    for port in (upload_world.nginx_port, upload_world.sidecar_port):
        pieces = _pieces(data, data.index(b"\r\n\r\n") + 4, split, random.Random(target))
        raw = d.send_in_pieces(port, pieces)
        statuses = [r.status for r in d.parse_responses(raw, ["GET", "GET"])]
        seen = upload_world.upstream.take()
        results.append((statuses, [d.received_comparable(g) for g in seen]))
        assert [g.target.encode("latin-1") for g in seen] == [target, b"/raw/next"]
    assert results[0][0] == [200, 200]
    assert results[1] == results[0]


# ``Upgrade: h2c`` (curl --http2 to an http:// URL, or a probe): never acted on. The request is
# answered as HTTP/1.1 and goes upstream without Upgrade and HTTP2-Settings, as nginx sends it;
# bodiless (the case a 101 would turn into a tunnel) and with a body, in each variant.
H2C_SETTINGS = b"AAMAAABkAAQCAAAAAAIAAAAA"


def _h2c_request(variant: str, body: bytes, tag: str) -> tuple[bytes, int]:
    version = b"HTTP/1.0" if variant == "http10" else b"HTTP/1.1"
    connection = b"Upgrade, HTTP2-Settings" + (b", close" if variant == "close" else b"")
    target = b"/up/h2c-" + tag.encode() if body else b"/raw/h2c-" + tag.encode()
    head = b"%s %s %s\r\nHost: up.test\r\nConnection: %s\r\nUpgrade: h2c\r\n" % (
        b"POST" if body else b"GET",
        target,
        version,
        connection,
    )
    head += b"HTTP2-Settings: %s\r\nX-Case: %s\r\n" % (H2C_SETTINGS, tag.encode())
    if body:
        head += b"Content-Length: %d\r\n" % len(body)
    head += b"\r\n"
    after = NEXT if variant == "keepalive" else AFTER_CLOSE
    if not body:
        after = after.replace(b" /", b" /raw/", 1)
    return head + body + after, len(head)


def _received_with_upgrade(
    got: d.Received, leave_out: frozenset[str] = frozenset()
) -> tuple[str, str, list[tuple[str, str]], str]:
    """What the upstream got (method, target, headers, body digest), ``Upgrade`` and
    ``HTTP2-Settings`` included (the comparison of the upload cases leaves ``Upgrade`` out as
    hop-by-hop); ``Connection``, the sidecar's documented additions and ``leave_out`` not."""
    ignored = d.REQUEST_ADDITIONS | {"content-length", "transfer-encoding"} | leave_out
    headers = [(k.lower(), v) for k, v in got.headers if k.lower() not in ignored]
    return got.method, got.target, headers, hashlib.sha256(got.body).hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("split", ("random", "bytewise", "whole"))
@pytest.mark.parametrize("body", (b"", b"hello h2c"), ids=("bodiless", "body"))
@pytest.mark.parametrize("variant", UPLOAD_VARIANTS)
def test_an_h2c_upgrade_reaches_the_upstream_as_nginx_sends_it(
    upload_world: UploadWorld, variant: str, body: bytes, split: str
):
    """Issue 29 item 9: the sidecar sent ``Upgrade: h2c`` upstream and, on the upstream's
    101, tunnelled the client's HTTP/2 frames past the routing rules. nginx answers as
    HTTP/1.1 and forwards no Upgrade; the sidecar now does the same. One documented
    difference stays: nginx forwards ``HTTP2-Settings`` (named by Connection, and
    connection-specific in RFC 7540), the sidecar drops it."""
    tag = f"{variant}-{len(body)}-{split}"
    data, head_len = _h2c_request(variant, body, tag)
    methods = ["POST" if body else "GET", "GET"] if variant == "keepalive" else ["GET"]
    results = []
    for port in (upload_world.nginx_port, upload_world.sidecar_port):
        pieces = _pieces(data, head_len, split, random.Random(tag))
        raw = d.send_in_pieces(port, pieces)
        replies = d.parse_responses(raw, methods)
        assert all(r.header(b"upgrade") is None for r in replies), raw[:300]
        # The documented difference: nginx passes HTTP2-Settings on, the sidecar never.
        ngx = port == upload_world.nginx_port
        leave_out = frozenset({"http2-settings"} if ngx else ())
        seen = [_received_with_upgrade(g, leave_out) for g in upload_world.upstream.take()]
        results.append(([r.status for r in replies], seen))
    (ngx_status, ngx_seen), (sc_status, sc_seen) = results
    assert ngx_status == [200] * len(methods), ngx_status
    assert sc_status == ngx_status
    assert sc_seen == ngx_seen
    assert all(k not in ("upgrade", "http2-settings") for k, _ in sc_seen[0][2])


DLQ_CASES = [
    Upload(variant, chunked, size, split)
    for variant in UPLOAD_VARIANTS
    for chunked in ((False,) if variant == "http10" else (False, True))
    for size in (KIB, 64 * KIB)  # up to retry.max_body_bytes: buffered, so it can be stored
    for split in ("bytewise", "random", "head-and-some")
]


@pytest.mark.slow
@pytest.mark.parametrize("case", DLQ_CASES, ids=[c.name for c in DLQ_CASES])
def test_a_dlq_route_stores_the_whole_body_at_any_split(upload_world: UploadWorld, case: Upload):
    body = _body(case.size, case.size + 1)
    data, head_len = _upload_bytes(case, body)
    data = data.replace(b"PUT /up/", b"PUT /dlq/", 1)
    methods = ["PUT", "GET"] if case.variant == "keepalive" else ["PUT"]
    pieces = _pieces(data, head_len, case.split, random.Random(case.name))
    raw = d.send_in_pieces(upload_world.sidecar_port, pieces)
    replies = d.parse_responses(raw, methods)
    assert [r.status for r in replies] == [503, 200][: len(methods)], raw[:300]
    assert replies[0].header(b"x-retry-dlq") == b"stored"
    rid = (replies[0].header(b"x-retry-dlq-id") or b"").decode()
    conn = sqlite3.connect(upload_world.tmp / "dlq.sqlite3")
    try:
        row = conn.execute("SELECT target, body FROM records WHERE id = ?", (rid,)).fetchone()
    finally:
        conn.close()
    assert row is not None and row[0] == f"/dlq/{case.name}?q=1"
    assert bytes(row[1]) == body
    upload_world.upstream.take()

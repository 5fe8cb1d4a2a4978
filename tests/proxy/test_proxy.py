"""The proxy and its retry engine over real sockets: a scripted aiohttp upstream, the sidecar
in front, and assertions on what the upstream saw and what the client got."""

from __future__ import annotations

import asyncio
import gzip
import json

import aiohttp
import pytest

from tests.conftest import hang, reply, reset, routes_yaml
from tests.rawhttp import canned, raw_request, raw_server


async def test_503_then_200_is_retried_with_attempt_headers(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503, b"busy"), reply(200, b"fine"))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200
        assert await resp.read() == b"fine"
        assert resp.headers["x-retry-attempts"] == "2"
        assert resp.headers["x-retry-fate"] == "success"
    assert [s.header("x-retry-attempt") for s in up.seen] == ["1", "2"]
    budgets = [int(s.header("x-request-timeout-ms") or -1) for s in up.seen]
    assert 0 < budgets[1] <= budgets[0] <= 60_000  # the default route timeout, as nginx
    assert all(s.header("x-retry-edge") == "test-edge" for s in up.seen)
    # No traceparent came, so no tracestate goes (W3C Trace Context section 4.2).
    assert all(s.header("tracestate") is None for s in up.seen)


async def test_exhausted_returns_last_upstream_response_as_it_was(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503, b"down", {"X-Why": "maintenance"}))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 503
        assert await resp.read() == b"down"
        assert resp.headers["X-Why"] == "maintenance"
        assert resp.headers["x-retry-attempts"] == "3"
        assert resp.headers["x-retry-fate"] == "exhausted"
        assert "x-retry-proxy-error" not in resp.headers
    assert len(up.seen) == 3


async def test_not_retryable_status_is_returned_at_once(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(500, b"bug"))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 500
        assert resp.headers["x-retry-fate"] == "not-retryable"
    assert len(up.seen) == 1


async def test_reset_is_retried(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reset(), reply(200, b"after reset"))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200 and await resp.read() == b"after reset"
        assert resp.headers["x-retry-attempts"] == "2"
    assert sc.recorder.attempts[0].outcome == "reset"


async def test_hang_is_cut_by_per_try_timeout_and_retried(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(hang(), reply(200, b"quick"))
    sc = await sidecar_factory(routes_yaml(up.url, "    retry: {per_try_timeout: 200ms}"))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200 and await resp.read() == b"quick"
    assert [a.outcome for a in sc.recorder.attempts] == ["per-try-timeout", "200"]


async def test_overall_deadline_gives_504(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(hang())
    sc = await sidecar_factory(
        routes_yaml(up.url, "    timeout: 500ms\n    retry: {per_try_timeout: 200ms, attempts: 10}")
    )
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 504
        body = await resp.json()
        assert resp.headers["x-retry-proxy-error"] == "deadline"
        assert resp.headers["x-retry-fate"] == "deadline"
        assert body["fate"] == "deadline" and body["attempts"] == int(
            resp.headers["x-retry-attempts"]
        )
    assert 2 <= len(up.seen) <= 3


async def test_connect_failure_gives_502_after_retries(sidecar_factory, client, unused_tcp_port):
    sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{unused_tcp_port}"))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 502
        assert resp.headers["x-retry-proxy-error"] == "connect-failure"
        assert resp.headers["x-retry-fate"] == "exhausted"
        body = await resp.json()
        assert body["attempts"] == 3 and "error" in body


@pytest.mark.slow
async def test_retry_after_is_honoured(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503, b"", {"Retry-After": "1"}), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200
    [scheduled] = sc.recorder.retries
    assert scheduled.from_retry_after and 1.0 <= scheduled.delay <= 1.1


async def test_retry_after_beyond_deadline_stops_now(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(503, b"later", {"Retry-After": "60"}))
    sc = await sidecar_factory(routes_yaml(up.url, "    timeout: 2s"))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 503 and await resp.read() == b"later"
        assert resp.headers["x-retry-fate"] == "retry-after-too-long"
        assert resp.headers["x-retry-attempts"] == "1"
    assert len(up.seen) == 1


async def test_post_without_idempotency_key_is_not_resent(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.post(sc.url + "/orders", data=b"{}") as resp:
        assert resp.status == 503
        assert resp.headers["x-retry-fate"] == "non-idempotent"
    assert len(up.seen) == 1


async def test_post_with_idempotency_key_is_resent_unchanged(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503), reply(201, b"created"))
    sc = await sidecar_factory(routes_yaml(up.url))
    body = b'{"item": 42}'
    async with client.post(
        sc.url + "/orders", data=body, headers={"Idempotency-Key": "k-123"}
    ) as resp:
        assert resp.status == 201
    assert [s.header("Idempotency-Key") for s in up.seen] == ["k-123", "k-123"]
    assert [s.body for s in up.seen] == [body, body]
    assert [s.header("Content-Length") for s in up.seen] == [str(len(body))] * 2


async def test_post_connect_failure_is_retried_for_any_method(
    sidecar_factory, unused_tcp_port_factory
):
    # Nothing reached the upstream, so even a POST without a key may be retried.
    port = unused_tcp_port_factory()
    sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
    async with aiohttp.ClientSession() as s, s.post(sc.url + "/x", data=b"a") as resp:
        assert resp.status == 502
        assert resp.headers["x-retry-attempts"] == "3"


async def test_large_body_streams_once_and_is_never_resent(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url, "    retry: {max_body_bytes: 16}"))
    body = bytes(range(256)) * 40

    async def gen():
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    async with client.put(sc.url + "/blob", data=gen()) as resp:  # chunked upload
        assert resp.status == 503
        assert resp.headers["x-retry-fate"] == "body-too-large"
    assert len(up.seen) == 1 and up.seen[0].body == body
    async with client.put(sc.url + "/blob", data=body) as resp:  # Content-Length upload
        assert resp.status == 200
    assert up.seen[1].body == body and up.seen[1].header("Content-Length") == str(len(body))


async def test_request_body_over_limit_gets_413_before_any_upstream_call(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url, top_extra="limits: {max_request_body: 1KiB}"))
    async with client.post(sc.url + "/x", data=b"x" * 2048) as resp:
        assert resp.status == 413
    assert up.seen == []


async def test_gzip_bodies_pass_through_byte_identical(upstream_factory, sidecar_factory, client):
    payload = gzip.compress(b"hello " * 1000)
    up = await upstream_factory(
        reply(200, payload, {"Content-Encoding": "gzip", "Content-Type": "text/plain"})
    )
    sc = await sidecar_factory(routes_yaml(up.url))
    req_body = gzip.compress(b"request " * 100)
    async with client.put(
        sc.url + "/z",
        data=req_body,
        headers={"Content-Encoding": "gzip", "Accept-Encoding": "gzip"},
    ) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Encoding"] == "gzip"
        assert await resp.read() == payload
    assert up.seen[0].body == req_body
    assert up.seen[0].header("Content-Encoding") == "gzip"


async def test_odd_paths_are_forwarded_byte_exact(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    target = "/a%2Fb/%3A;x?x=%20&y=%2f&z"
    data = f"GET {target} HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n".encode()
    out = await raw_request(sc.sidecar.proxy_port, data)
    assert out.startswith(b"HTTP/1.1 200")
    assert up.seen[0].raw_path == target


async def test_no_headers_are_invented_either_way(sidecar_factory):
    response = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Only: this\r\n\r\nhi"
    seen: list[bytes] = []

    async def h(r, w):
        seen.append(await r.readuntil(b"\r\n\r\n"))
        w.write(response)
        await w.drain()

    async with raw_server(h) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET /p HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        )
    head, _, body = out.partition(b"\r\n\r\n")
    names = {line.split(b":")[0].lower() for line in head.split(b"\r\n")[1:]}
    assert body == b"hi"
    assert names == {
        b"content-length",
        b"x-only",
        b"x-retry-attempts",
        b"x-retry-fate",
        b"connection",
    }
    sent = seen[0].lower()
    for injected in (b"user-agent", b"accept-encoding", b"accept:", b"content-type"):
        assert injected not in sent


async def test_reason_phrase_is_not_copied(sidecar_factory):
    async with raw_server(
        canned(b"HTTP/1.1 200 Totally Fine\r\nContent-Length: 0\r\n\r\n")
    ) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: h\r\nConnection: close\r\n\r\n"
        )
    assert out.startswith(b"HTTP/1.1 200 OK\r\n")


async def test_hop_by_hop_headers_are_dropped_and_forwarding_headers_added(
    upstream_factory, sidecar_factory
):
    up = await upstream_factory(reply(200, b"ok", {"X-Private": "p", "Connection": "X-Private"}))
    sc = await sidecar_factory(routes_yaml(up.url))
    req = (
        b"GET /h HTTP/1.1\r\nHost: app.example\r\nConnection: keep-alive, X-Secret, x-retry-attempt\r\n"
        b"X-Secret: s\r\nKeep-Alive: timeout=5\r\nTE: trailers\r\nProxy-Authorization: basic x\r\n"
        b"Upgrade: h2c\r\nX-Forwarded-For: 10.1.1.1\r\nX-Keep: yes\r\n\r\n"
    )
    out = await raw_request(sc.sidecar.proxy_port, req, timeout=1.0)
    assert out.startswith(b"HTTP/1.1 200")
    assert b"x-private" not in out.lower()
    s = up.seen[0]
    for dropped in ("X-Secret", "Keep-Alive", "TE", "Proxy-Authorization", "Upgrade", "Connection"):
        assert s.header(dropped) is None, dropped
    assert s.header("X-Keep") == "yes"
    assert s.header("X-Forwarded-For") == "10.1.1.1, 127.0.0.1"
    assert s.header("X-Forwarded-Host") == "app.example"
    assert s.header("X-Forwarded-Proto") == "http"
    assert s.header("Host") == "app.example"
    # Named in Connection, but the sidecar's own header is still sent.
    assert s.header("x-retry-attempt") == "1"


async def test_upstream_dying_mid_body_breaks_the_client_response(sidecar_factory, client):
    partial = b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n" + b"x" * 100
    async with raw_server(canned(partial)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        with pytest.raises(aiohttp.ClientPayloadError):
            async with client.get(sc.url + "/x") as resp:
                await resp.read()


async def test_chunked_upstream_dying_mid_body_is_not_a_whole_response(sidecar_factory):
    partial = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n"
    async with raw_server(canned(partial)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: h\r\n\r\n", 5.0)
    assert out.startswith(b"HTTP/1.1 200")
    assert b"hello" in out
    assert not out.endswith(b"0\r\n\r\n")  # no terminating chunk: the client sees it broke


async def test_chunked_and_eof_delimited_responses_are_relayed(sidecar_factory, client):
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n"
    async with raw_server(canned(chunked, close=False)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        for _ in range(3):  # the pooled connection is reused
            async with client.get(sc.url + "/x") as resp:
                assert await resp.read() == b"hello world"
        stats = next(iter(sc.sidecar.client.stats().values()))
        assert stats.total == 1 and stats.idle == 1
    eof = b"HTTP/1.0 200 OK\r\n\r\nuntil close"
    async with raw_server(canned(eof)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        async with client.get(sc.url + "/x") as resp:
            assert await resp.read() == b"until close"


async def test_head_keeps_content_length_and_connection_is_reused(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(200, b"0123456789"))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.head(sc.url + "/x") as resp:
        assert resp.status == 200 and resp.headers["Content-Length"] == "10"
    async with client.get(sc.url + "/x") as resp:
        assert await resp.read() == b"0123456789"
    stats = next(iter(sc.sidecar.client.stats().values()))
    assert stats.total == 1


async def test_no_route_gives_404_json(upstream_factory, sidecar_factory, client):
    up = await upstream_factory(reply(200))
    yaml_text = routes_yaml(up.url).replace(
        "    upstream:", "    match: {path_prefix: /api, methods: [GET]}\n    upstream:"
    )
    sc = await sidecar_factory(yaml_text)
    async with client.get(sc.url + "/other") as resp:
        assert resp.status == 404
        assert "no route" in (await resp.json())["error"]
    async with client.post(sc.url + "/api/x") as resp:
        assert resp.status == 404
    async with client.get(sc.url + "/api/x") as resp:
        assert resp.status == 200


async def test_retry_headers_from_untrusted_peers_are_ignored(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url, top_extra='trusted_peers: ["10.0.0.0/8"]'))
    async with client.get(
        sc.url + "/x",
        headers={
            "x-retry-edge": "evil",
            "x-request-timeout-ms": "1",
            "tracestate": "retry-sidecar=edge",
        },
    ) as resp:
        assert resp.status == 200 and resp.headers["x-retry-attempts"] == "2"
    assert up.seen[0].header("x-retry-edge") == "test-edge"
    assert int(up.seen[0].header("x-request-timeout-ms") or 0) > 1000


async def test_trusted_edge_marker_means_one_attempt_and_is_passed_on(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(
        sc.url + "/x", headers={"x-retry-edge": "outer", "x-request-timeout-ms": "700"}
    ) as resp:
        assert resp.status == 503
        assert resp.headers["x-retry-fate"] == "edge-owned"
    assert len(up.seen) == 1
    assert up.seen[0].header("x-retry-edge") == "outer"
    assert 0 < int(up.seen[0].header("x-request-timeout-ms") or 0) <= 700


async def test_sidecar_error_body_shape(sidecar_factory, client, unused_tcp_port):
    sc = await sidecar_factory(
        routes_yaml(f"http://127.0.0.1:{unused_tcp_port}", "    retry: {attempts: 1}")
    )
    async with client.get(sc.url + "/x") as resp:
        body = json.loads(await resp.read())
        assert set(body) == {"error", "fate", "attempts"}
        assert body["attempts"] == 1 and body["fate"] == "exhausted"
        assert resp.headers["Content-Type"] == "application/json"


async def test_http2_request_line_is_rejected(upstream_factory, sidecar_factory):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    out = await raw_request(sc.sidecar.proxy_port, b"GET / HTTP/2.0\r\nHost: h\r\n\r\n", 2.0)
    assert out.split(b" ")[1] in (b"400", b"505")
    assert up.seen == []
    assert (
        'retry_sidecar_malformed_requests_total{reason="http-version"} 1'
        in sc.sidecar.metrics.render()
    )


async def test_expect_100_continue_is_answered(upstream_factory, sidecar_factory):
    up = await upstream_factory(reply(200, b"thanks"))
    sc = await sidecar_factory(routes_yaml(up.url))
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"PUT /e HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    await w.drain()
    interim = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 0.5)  # no 1 s client wait
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    w.write(b"hello")
    await w.drain()
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200")
    w.close()
    assert up.seen[0].body == b"hello" and up.seen[0].header("Expect") is None


async def test_unknown_expectation_gets_417(upstream_factory, sidecar_factory):
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    out = await raw_request(
        sc.sidecar.proxy_port,
        b"PUT /e HTTP/1.1\r\nHost: h\r\nContent-Length: 1\r\nExpect: magic\r\nConnection: close\r\n\r\nx",
        3.0,
    )
    assert out.startswith(b"HTTP/1.1 417")
    assert up.seen == []


async def test_http10_client_without_host_gets_the_upstream_authority(
    upstream_factory, sidecar_factory
):
    up = await upstream_factory(reply(200, b"ok10"))
    sc = await sidecar_factory(routes_yaml(up.url))
    out = await raw_request(sc.sidecar.proxy_port, b"GET /old HTTP/1.0\r\n\r\n", 3.0)
    assert out.startswith(b"HTTP/1.0 200") and out.endswith(b"ok10")
    assert up.seen[0].header("Host") == f"127.0.0.1:{up.port}"


# -- a key the client names as hop-by-hop is no key ---------------------------------------------


async def test_a_key_named_in_connection_is_no_key_and_the_post_is_sent_once(
    upstream_factory, sidecar_factory
):
    """``Connection: Idempotency-Key`` makes the key hop-by-hop: it is dropped, so the upstream
    never sees it. The retry decision read the key from the client's headers all the same and
    resent the POST twice, keyless. The key is what goes upstream."""
    up = await upstream_factory(reply(503, b"down"))
    sc = await sidecar_factory(routes_yaml(up.url))
    port = sc.sidecar.proxy_port
    out = await raw_request(
        port,
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-123\r\n"
        b"Connection: Idempotency-Key, close\r\nContent-Length: 2\r\n\r\n{}",
    )
    assert out.startswith(b"HTTP/1.1 503"), out[:200]
    assert len(up.seen) == 1
    assert up.seen[0].header("Idempotency-Key") is None
    assert up.seen[0].body == b"{}"
    # The same POST with its key kept is resent, the key on every attempt.
    up.seen.clear()
    out = await raw_request(
        port,
        b"POST /orders HTTP/1.1\r\nHost: t\r\nIdempotency-Key: k-123\r\n"
        b"Connection: close\r\nContent-Length: 2\r\n\r\n{}",
    )
    assert [s.header("Idempotency-Key") for s in up.seen] == ["k-123"] * 3

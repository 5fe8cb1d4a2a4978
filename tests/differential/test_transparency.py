"""Byte-faithful HTTP/1.1: one regression test per defect found with real clients and servers.

Upstreams here are raw sockets, because each defect needs exact bytes that no framework sends
(obs-text, trailers, two responses in one write, invalid status codes...). The differential
suite against httpbin, nginx and real client libraries is tests/differential/test_differential.py.
"""

from __future__ import annotations

import asyncio
import re

import aiohttp
import pytest

from tests import faults
from tests.conftest import routes_yaml
from tests.rawhttp import raw_request, raw_server, read_head
from tests.wait import until

POLICY = "    breaker: {min_sequences: 100000}"


def split(resp: bytes) -> tuple[bytes, list[bytes], bytes]:
    head, _, body = resp.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    return lines[0], lines[1:], body


class counting:
    """Wrap a raw handler; ``connections`` counts accepted upstream connections."""

    def __init__(self, handler) -> None:
        self.handler = handler
        self.connections = 0

    async def __call__(self, r, w) -> None:
        self.connections += 1
        await self.handler(r, w)


async def test_obs_text_header_bytes_are_copied_not_reencoded(sidecar_factory):
    disposition = 'attachment; filename="ü.txt"'.encode()  # UTF-8 bytes, as apps send them
    response = (
        b"HTTP/1.1 200 OK\r\nContent-Disposition: " + disposition + b"\r\n"
        b"X-Latin: caf\xe9\r\nContent-Length: 2\r\n\r\nok"
    )
    async with raw_server(faults.per_connection(_answer(response))) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
    _, headers, body = split(out)
    assert b"Content-Disposition: " + disposition in headers
    assert b"X-Latin: caf\xe9" in headers
    assert body == b"ok"


def _answer(response: bytes):
    async def h(r, w):
        await read_head(r)
        w.write(response)
        await w.drain()
        await asyncio.sleep(0.2)

    return h


async def test_trailers_are_dropped_never_merged_into_the_head(sidecar_factory):
    response = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nTrailer: Set-Cookie\r\n\r\n"
        b"2\r\nok\r\n0\r\nSet-Cookie: stolen=1\r\nX-Checksum: abc\r\n\r\n"
    )
    async with raw_server(_answer(response)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
    status, headers, body = split(out)
    assert status == b"HTTP/1.1 200 OK"
    names = [h.split(b":")[0].lower() for h in headers]
    assert b"set-cookie" not in names and b"x-checksum" not in names
    assert b"trailer" not in names  # hop-by-hop: it announced trailers that are not sent
    assert b"transfer-encoding" in names and body == b"2\r\nok\r\n0\r\n\r\n"


async def test_a_content_length_trailer_breaks_the_response_visibly(sidecar_factory):
    # Content-Length is not allowed in a trailer section (RFC 9110 section 6.5.1); the
    # parser refuses the message, so the client sees a cut response, never a merged head.
    response = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\nok\r\n0\r\nContent-Length: 99\r\n\r\n"
    )
    async with raw_server(_answer(response)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
    _, headers, body = split(out)
    assert not any(h.lower().startswith(b"content-length") for h in headers)
    assert not body.endswith(b"0\r\n\r\n")  # no terminating chunk: visibly incomplete


async def test_bytes_after_a_complete_response_are_dropped_and_never_pooled(
    sidecar_factory, client
):
    two = (
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
        b"HTTP/1.1 302 Found\r\nLocation: http://evil.example/\r\nContent-Length: 0\r\n\r\n"
    )

    async def keep_answering(r, w):
        while True:
            await read_head(r)
            w.write(two)
            await w.drain()

    handler = counting(keep_answering)
    async with raw_server(handler) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        for _ in range(3):
            async with client.put(sc.url + "/x", data=b"v") as resp:
                assert resp.status == 200 and await resp.read() == b"ok"
                assert "Location" not in resp.headers
                assert resp.headers["x-retry-attempts"] == "1"
        await asyncio.sleep(0.05)
        # Each exchange got its own connection: a connection that sent more data is closed.
        assert handler.connections == 3
        for stats in sc.sidecar.client.stats().values():
            assert stats.total == stats.idle == 0


async def test_a_phantom_trailing_503_never_causes_a_resend(sidecar_factory, client):
    merged = (
        b"HTTP/1.1 201 Created\r\nContent-Length: 0\r\n\r\n"
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
    )
    seen = []

    async def h(r, w):
        while True:
            seen.append(await read_head(r))
            w.write(merged)
            await w.drain()

    async with raw_server(h) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        async with client.put(sc.url + "/x", data=b"v") as resp:
            assert resp.status == 201
        async with client.put(sc.url + "/x", data=b"v") as resp:
            assert resp.status == 201
    assert len(seen) == 2  # one PUT each, never three


async def test_head_response_followed_by_a_body_is_not_reused(sidecar_factory, client):
    response = b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"  # a body after HEAD
    handler = counting(_answer(response))
    async with raw_server(handler) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        async with client.head(sc.url + "/x") as resp:
            assert resp.status == 200 and resp.headers["Content-Length"] == "5"
        await asyncio.sleep(0.05)
        for stats in sc.sidecar.client.stats().values():
            assert stats.idle == 0


async def test_absolute_form_is_routed_and_forwarded_by_its_path(upstream_factory, sidecar_factory):
    api = await upstream_factory()
    sc = await sidecar_factory(
        routes_yaml(api.url, "    match: {path_prefix: /api}").replace("name: main", "name: api")
    )
    port = sc.sidecar.proxy_port
    out = await raw_request(
        port,
        b"GET http://other.example:8080/api/x?q=1 HTTP/1.1\r\nHost: spoofed\r\n"
        b"Connection: close\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 200")
    [seen] = api.seen
    assert seen.raw_path == "/api/x?q=1"  # origin-form upstream
    assert seen.all("Host") == ["other.example:8080"]  # Host from the URI (RFC 9112 3.2.2)
    # A path outside the prefix is not routed just because the URI says http://...
    out = await raw_request(
        port, b"GET http://other.example/admin HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    )
    assert out.startswith(b"HTTP/1.1 404")
    assert len(api.seen) == 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "request_bytes",
    [
        b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n",
        b"OPTIONS * HTTP/1.1\r\nHost: a\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: good evil\r\n\r\n",
        b"GET / HTTP/1.1\r\nHost: evil/x?y\r\n\r\n",
        b"GET http://user@evil/ HTTP/1.1\r\nHost: a\r\n\r\n",
    ],
)
async def test_unroutable_targets_and_invalid_hosts_get_400(
    upstream_factory, sidecar_factory, request_bytes
):
    up = await upstream_factory()
    sc = await sidecar_factory(routes_yaml(up.url))  # a match-all route
    out = await raw_request(sc.sidecar.proxy_port, request_bytes, timeout=2)
    status, headers, _ = split(out)
    assert status.startswith(b"HTTP/1.1 400")
    assert b"Proxy-Status: retry-sidecar; error=http_request_error" in headers
    assert up.seen == []


async def test_connection_naming_host_does_not_remove_it(upstream_factory, sidecar_factory):
    up = await upstream_factory()
    sc = await sidecar_factory(routes_yaml(up.url))
    out = await raw_request(
        sc.sidecar.proxy_port,
        b"GET / HTTP/1.1\r\nHost: app.example\r\nConnection: host, close\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 200")
    assert up.seen[0].all("Host") == ["app.example"]


@pytest.mark.parametrize("status", [b"000", b"099", b"101", b"600", b"999"])
async def test_invalid_status_codes_are_a_bad_response_never_retried(sidecar_factory, status):
    handler = counting(_answer(b"HTTP/1.1 " + status + b" X\r\nContent-Length: 2\r\n\r\nok"))
    async with raw_server(handler) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
    line, headers, _ = split(out)
    assert line.startswith(b"HTTP/1.1 502")
    assert b"x-retry-proxy-error: bad-response" in headers
    error = b"http_upgrade_failed" if status == b"101" else b"http_protocol_error"
    assert b"Proxy-Status: retry-sidecar; error=" + error in headers
    assert b"x-retry-attempts: 1" in headers and handler.connections == 1
    assert [a.outcome for a in sc.recorder.attempts] == ["bad-response"]


async def test_transfer_codings_other_than_chunked_are_refused(sidecar_factory):
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    async with raw_server(_answer(response)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
    line, headers, _ = split(out)
    assert line.startswith(b"HTTP/1.1 502")
    assert b"Proxy-Status: retry-sidecar; error=http_response_transfer_coding" in headers


async def test_a_too_large_response_head_is_not_retried(sidecar_factory):
    fields = b"".join(b"X-H%d: v\r\n" % i for i in range(300))
    handler = counting(_answer(b"HTTP/1.1 200 OK\r\n" + fields + b"Content-Length: 0\r\n\r\n"))
    async with raw_server(handler) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
    _, headers, _ = split(out)
    assert b"x-retry-proxy-error: bad-response" in headers
    assert b"Proxy-Status: retry-sidecar; error=http_response_header_section_size" in headers
    assert handler.connections == 1


async def test_an_early_answer_to_a_streamed_upload_is_relayed_and_not_a_failure(
    sidecar_factory, client
):
    async def refuse_early(r, w):
        await read_head(r)
        w.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\n\r\nnope")
        await w.drain()
        await asyncio.sleep(5)

    async with raw_server(refuse_early) as port:
        sc = await sidecar_factory(
            routes_yaml(
                f"http://127.0.0.1:{port}",
                "    retry: {max_body_bytes: 16}\n"
                "    breaker: {min_sequences: 5, failure_ratio: 0.5}",
            )
        )

        async def slow_upload():
            for _ in range(50):
                yield b"x" * 1024
                await asyncio.sleep(0.1)  # 5 s if the sidecar waited for all of it

        loop = asyncio.get_running_loop()
        for _ in range(8):
            t0 = loop.time()
            async with client.put(sc.url + "/upload", data=slow_upload()) as resp:
                assert resp.status == 413 and await resp.read() == b"nope"
                assert resp.headers["x-retry-fate"] == "not-retryable"
            assert loop.time() - t0 < 4  # answered when the upstream answered
        breakers = sc.sidecar.states.get("main").breaker
        assert breakers.state.value == "closed"
        assert [a.outcome for a in sc.recorder.attempts] == ["413"] * 8
        for stats in sc.sidecar.client.stats().values():
            assert stats.total == stats.idle  # the abandoned connections are closed


async def test_a_pause_in_the_body_longer_than_the_per_try_timeout_is_relayed(
    sidecar_factory, client
):
    async def pause(r, w):
        await read_head(r)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhello")
        await w.drain()
        await asyncio.sleep(0.8)  # four per-try timeouts of silence
        w.write(b"world")
        await w.drain()
        await asyncio.sleep(0.2)

    async with raw_server(pause) as port:
        sc = await sidecar_factory(
            routes_yaml(f"http://127.0.0.1:{port}", "    retry: {per_try_timeout: 200ms}")
        )
        async with client.get(sc.url + "/sse") as resp:
            assert await resp.read() == b"helloworld"
        assert [s.fate for s in sc.recorder.sequences] == ["success"]


async def test_a_slow_streamed_upload_longer_than_the_deadline_succeeds(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory()
    sc = await sidecar_factory(
        routes_yaml(up.url, "    timeout: 400ms\n    retry: {max_body_bytes: 16}")
    )

    async def slow():
        for _ in range(8):
            await asyncio.sleep(0.1)  # 0.8 s in all, twice the deadline
            yield b"y" * 100

    async with client.put(sc.url + "/up", data=slow()) as resp:
        assert resp.status == 200 and resp.headers["x-retry-fate"] == "success"
    assert len(up.seen[0].body) == 800


async def test_http10_keep_alive_client_gets_a_close_delimited_body(sidecar_factory):
    response = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n"
    async with raw_server(_answer(response)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        out = await raw_request(
            sc.sidecar.proxy_port,
            b"GET / HTTP/1.0\r\nHost: a\r\nConnection: keep-alive\r\n\r\n",
            timeout=5,
        )
        assert loop.time() - t0 < 2  # closed at once, not after the keep-alive timeout
    line, headers, body = split(out)
    assert line == b"HTTP/1.0 200 OK" and body == b"ok"
    assert not any(h.lower().startswith(b"connection: keep-alive") for h in headers)


async def test_1xx_responses_are_relayed_in_order_to_http11_clients_only(sidecar_factory):
    response = (
        b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\n"
        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
    )
    async with raw_server(_answer(response)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
        )
        assert out.startswith(
            b"HTTP/1.1 103 Early Hints\r\nLink: </s.css>; rel=preload\r\n\r\nHTTP/1.1 200"
        )
        out10 = await raw_request(sc.sidecar.proxy_port, b"GET / HTTP/1.0\r\nHost: a\r\n\r\n")
        assert out10.startswith(b"HTTP/1.0 200")


@pytest.mark.slow
async def test_own_errors_carry_proxy_status_and_no_banner_or_address(
    sidecar_factory, unused_tcp_port
):
    sc = await sidecar_factory(
        routes_yaml(f"http://127.0.0.1:{unused_tcp_port}", "    retry: {attempts: 1}")
    )
    out = await raw_request(
        sc.sidecar.proxy_port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
    )
    line, headers, body = split(out)
    assert line.startswith(b"HTTP/1.1 502")
    assert b"Proxy-Status: retry-sidecar; error=connection_refused" in headers
    assert b"x-retry-proxy-error: connect-failure" in headers
    assert not any(h.lower().startswith(b"server:") for h in headers)
    assert b"127.0.0.1" not in body and str(unused_tcp_port).encode() not in body
    # Refusals before routing, and malformed requests, say so too.
    sc2 = await sidecar_factory(
        routes_yaml(f"http://127.0.0.1:{unused_tcp_port}", "    match: {path: /only}")
    )
    out = await raw_request(sc2.sidecar.proxy_port, b"GET /x HTTP/1.1\r\nHost: a\r\n\r\n", 2)
    assert b"Proxy-Status: retry-sidecar; error=destination_not_found" in out
    out = await raw_request(sc2.sidecar.proxy_port, b"GET /x HTTP/1.1\r\nBad Header\r\n\r\n", 2)
    assert b"Proxy-Status: retry-sidecar; error=http_request_error" in out
    assert b"Server:" not in out


async def test_data_pipelined_after_connection_close_is_ignored(upstream_factory, sidecar_factory):
    up = await upstream_factory()
    sc = await sidecar_factory(routes_yaml(up.url))
    out = await raw_request(
        sc.sidecar.proxy_port,
        b"GET /one HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\nGARBAGE\r\n\r\n"
        b"GET /two HTTP/1.1\r\nHost: a\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 200") and out.count(b"HTTP/1.1") == 1
    assert [s.raw_path for s in up.seen] == ["/one"]
    # With a body announced by Content-Length, the body is read and the rest ignored.
    out = await raw_request(
        sc.sidecar.proxy_port,
        b"POST /three HTTP/1.1\r\nHost: a\r\nConnection: close\r\nContent-Length: 3\r\n\r\nabcJUNK",
    )
    assert out.startswith(b"HTTP/1.1 200")
    assert up.seen[-1].body == b"abc"


async def test_a_client_leaving_mid_upload_leaves_no_task_or_connection(
    upstream_factory, sidecar_factory
):
    """The streamed send races the client's body against the upstream's answer with two
    tasks; a client that leaves half-way must leave neither behind."""
    up = await upstream_factory()
    sc = await sidecar_factory(
        routes_yaml(up.url, "    retry: {max_body_bytes: 16}"),
    )
    baseline = len(asyncio.all_tasks())
    for _ in range(3):
        _r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        w.write(b"PUT /up HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n" + b"z" * 30000)
        await w.drain()
        await until(
            lambda: any(s.total > s.idle for s in sc.sidecar.client.stats().values()),
            "the upload to stream upstream",
        )
        w.transport.abort()  # the client leaves half-way

    def all_given_back() -> bool:
        stats = list(sc.sidecar.client.stats().values())
        return len(asyncio.all_tasks()) <= baseline and all(s.total == s.idle for s in stats)

    await until(all_given_back, "every task and connection given back")
    assert len(asyncio.all_tasks()) <= baseline, asyncio.all_tasks()
    for stats in sc.sidecar.client.stats().values():
        assert stats.total == stats.idle


# -- bodies the upstream must not be read past: bytes after the answer, bodiless answers ------


async def test_an_unsolicited_response_in_the_same_segment_is_neither_merged_nor_pooled(
    sidecar_factory,
):
    """The upstream answers 200 "ok" and, in the same TCP segment, a second response nobody
    asked for. ``Connection.data_received`` only checks ``complete`` before feeding the parser,
    so httptools parses both messages in one ``feed_data``: the second head overwrites
    ``status`` (503) and appends its headers (two Content-Length values reach the client), the
    sequence retries a request the upstream answered 200 (three sends), and the connection --
    whose state is unknown -- is released to the pool as reusable. nginx relays the first
    response and closes the upstream connection ("upstream sent more data than specified")."""

    async def two_answers(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_head(r)
            seen.append(1)
            w.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"
                b"HTTP/1.1 503 Smuggled\r\nX-Smuggled: yes\r\nContent-Length: 0\r\n\r\n"
            )
            await w.drain()

    seen: list[int] = []
    async with raw_server(two_answers) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        out = await raw_request(
            sc.sidecar.proxy_port, b"GET /x HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n", 5
        )
        head, _, body = out.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200"), head
        assert body == b"ok"
        assert len(re.findall(rb"(?im)^content-length:", head)) == 1, head
        assert b"X-Smuggled" not in head
        assert len(seen) == 1  # answered once: nothing to retry
        # A connection that spoke out of turn is closed, never pooled.
        assert all(p.total == 0 for p in sc.sidecar.client.stats().values())


async def test_head_204_and_304_answers_leave_the_connection_reusable(sidecar_factory):
    """Bodiless answers whose head announces a length (HEAD, 304) or none (204): the exchange is
    complete at the head, the client gets no body, and the one upstream connection is reused
    for every request."""
    connections = [0]

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        connections[0] += 1
        while True:
            head = await read_head(r)
            if head.startswith(b"HEAD"):
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1000\r\n\r\n")
            elif b"/204" in head:
                w.write(b"HTTP/1.1 204 No Content\r\n\r\n")
            elif b"/304" in head:
                w.write(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1000\r\n\r\n")
            else:
                w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await w.drain()

    async with raw_server(upstream) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}"))
        async with aiohttp.ClientSession() as s:
            for method, path, status, body in (
                ("HEAD", "/h", 200, b""),
                ("GET", "/204", 204, b""),
                ("GET", "/304", 304, b""),
                ("GET", "/ok", 200, b"ok"),
                ("HEAD", "/h", 200, b""),
                ("GET", "/ok", 200, b"ok"),
            ):
                async with s.request(method, sc.url + path) as r:
                    assert (r.status, await r.read()) == (status, body)
        assert connections[0] == 1
        assert [(p.total, p.idle) for p in sc.sidecar.client.stats().values()] == [(1, 1)]

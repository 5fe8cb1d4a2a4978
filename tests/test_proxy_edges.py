"""Requests at the edges of the proxy's rules, found by an outside attack: a key the client
names as hop-by-hop, an Upgrade other than websocket with a body and a request pipelined after
it, a method with bytes over 0x7F, and the fate of an upgrade the upstream refuses."""

from __future__ import annotations

import pytest

from sidecar.proxy.framing import escape_request_line
from tests.conftest import reply, routes_yaml
from tests.rawhttp import raw_request


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


async def test_a_request_pipelined_after_an_h2c_upgrade_with_a_body_is_answered(
    upstream_factory, sidecar_factory
):
    """``curl --http2 -d`` to an http:// URL: a POST with ``Upgrade: h2c`` and a body. It is
    proxied as an ordinary request; the request pipelined behind it was lost (the framing
    stopped cutting after any Upgrade, and the parser dropped what followed the body)."""
    up = await upstream_factory(reply(200, b"ok"))
    sc = await sidecar_factory(routes_yaml(up.url))
    first = (
        b"POST /first HTTP/1.1\r\nHost: t\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n"
        b"Content-Length: 5\r\n\r\nhello"
    )
    second = b"GET /second HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    out = await raw_request(sc.sidecar.proxy_port, first + second, timeout=5)
    assert out.count(b"HTTP/1.1 200") == 2, out
    assert [s.raw_path for s in up.seen] == ["/first", "/second"]
    assert up.seen[0].body == b"hello"


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


@pytest.mark.slow
async def test_an_upgrade_the_upstream_refuses_ends_not_retryable(
    upstream_factory, sidecar_factory
):
    """An upgrade is sent once: a 503 answer to it is relayed with fate ``not-retryable``,
    not ``body-too-large`` (it has no body)."""
    up = await upstream_factory(reply(503, b"busy"))
    sc = await sidecar_factory(routes_yaml(up.url))
    out = await raw_request(
        sc.sidecar.proxy_port,
        b"GET /ws HTTP/1.1\r\nHost: t\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n"
        b"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        timeout=5,
    )
    assert out.startswith(b"HTTP/1.1 503"), out[:200]
    assert b"x-retry-fate: not-retryable" in out.lower()
    assert len(up.seen) == 1

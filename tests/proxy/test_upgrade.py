"""HTTP Upgrade (WebSocket) through the real sidecar process (uvloop, as shipped), with real
servers (websockets, aiohttp, python-socketio on aiohttp) and real clients (websockets,
aiohttp's ws_connect, python-socketio's client) on loopback; and the upgrades it does not
tunnel (h2c with a body, an upgrade the upstream refuses), in-process."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import re
import signal
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest
import websockets
from aiohttp import web

from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port
from tests.rawhttp import raw_request, raw_server, read_head
from tests.wait import until

MIB = bytes(range(256)) * 4096


@asynccontextmanager
async def ws_echo_server() -> AsyncIterator[int]:
    """The websockets package's server: echoes every message; "bye" makes it close."""

    async def echo(ws: websockets.ServerConnection) -> None:
        async for message in ws:
            if message == "bye":
                await ws.close(4000, "server says bye")
                return
            await ws.send(message)

    async with websockets.serve(echo, "127.0.0.1", 0, max_size=None) as server:
        yield server.sockets[0].getsockname()[1]


@asynccontextmanager
async def aiohttp_app(app: web.Application) -> AsyncIterator[int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


@asynccontextmanager
async def sidecar(
    tmp_path: Path, upstream: int, extra: str = "", route: str = ""
) -> AsyncIterator[tuple[int, int, SidecarProcess]]:
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n{extra}"
        f"routes:\n  - name: ws\n    upstream: http://127.0.0.1:{upstream}\n{route}"
    )
    proc = SidecarProcess(cfg)
    proc.start()
    try:
        await proc.wait_port(port, admin)
        yield port, admin, proc
    finally:
        proc.terminate()


def metric(admin: int, name: str, **labels: str) -> float:
    """One series of the sidecar's /metrics (a blocking read: the sidecar is another
    process, and ``until`` polls plain conditions)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
        text = r.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^retry_sidecar_{name}\{{{re.escape(want)}\}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


async def test_websockets_echo_text_binary_and_a_mib_then_the_server_closes(
    tmp_path: Path,
) -> None:
    async with ws_echo_server() as up, sidecar(tmp_path, up) as (port, admin, _):
        async with websockets.connect(f"ws://127.0.0.1:{port}/chat", max_size=None) as ws:
            await ws.send("hello")
            assert await ws.recv() == "hello"
            await ws.send(b"\x00\x01\xff")
            assert await ws.recv() == b"\x00\x01\xff"
            await ws.send(MIB)
            assert await ws.recv() == MIB
            assert metric(admin, "upgrades_in_flight", route="ws") == 1
            await ws.send("bye")  # the server closes
            await ws.wait_closed()
            assert ws.close_code == 4000 and ws.close_reason == "server says bye"
        await until(
            lambda: metric(admin, "upgrades_total", route="ws", result="closed") == 1,
            "the tunnel counted closed",
        )
        assert metric(admin, "upgrades_in_flight", route="ws") == 0
        assert metric(admin, "requests_total", route="ws", fate="success") == 1


async def test_aiohttp_client_and_server_and_the_client_closes(tmp_path: Path) -> None:
    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse(max_msg_size=0)
        await ws.prepare(request)
        async for msg in ws:
            if msg.type == aiohttp.WSMsgType.TEXT:
                await ws.send_str("echo:" + msg.data)
            elif msg.type == aiohttp.WSMsgType.BINARY:
                await ws.send_bytes(msg.data)
        return ws

    app = web.Application()
    app.router.add_get("/ws", handler)
    async with aiohttp_app(app) as up, sidecar(tmp_path, up) as (port, admin, _):
        async with aiohttp.ClientSession() as s:
            async with s.ws_connect(f"http://127.0.0.1:{port}/ws", max_msg_size=0) as ws:
                await ws.send_str("hi")
                assert (await ws.receive()).data == "echo:hi"
                await ws.send_bytes(MIB)
                assert (await ws.receive()).data == MIB
            assert ws.closed and ws.close_code == 1000  # the client's close, answered
        await until(
            lambda: metric(admin, "upgrades_in_flight", route="ws") == 0, "the tunnel closed"
        )
        assert metric(admin, "upgrades_total", route="ws", result="closed") == 1


async def test_python_socketio_client_and_server_over_websocket(tmp_path: Path) -> None:
    import socketio  # type: ignore[import-untyped]

    sio = socketio.AsyncServer(async_mode="aiohttp")

    async def ping(sid: str, data: str) -> None:
        await sio.emit("pong", data.upper(), to=sid)

    sio.on("ping", ping)

    app = web.Application()
    sio.attach(app)
    async with aiohttp_app(app) as up, sidecar(tmp_path, up) as (port, admin, _):
        client = socketio.AsyncClient()
        got: asyncio.Queue[str] = asyncio.Queue()
        client.on("pong", got.put_nowait)
        await client.connect(f"http://127.0.0.1:{port}", transports=["websocket"])
        try:
            assert client.transport() == "websocket"
            await client.emit("ping", "through the sidecar")
            assert await asyncio.wait_for(got.get(), 15) == "THROUGH THE SIDECAR"
            assert metric(admin, "upgrades_in_flight", route="ws") == 1
        finally:
            await client.disconnect()
        await until(
            lambda: metric(admin, "upgrades_in_flight", route="ws") == 0, "the tunnel closed"
        )


async def test_an_upstream_refusing_the_upgrade_is_relayed_as_it_answered(
    tmp_path: Path,
) -> None:
    async def handler(request: web.Request) -> web.Response:
        assert request.headers.get("Upgrade") == "websocket"
        return web.Response(status=403, text="no sockets for you")

    app = web.Application()
    app.router.add_get("/ws", handler)
    async with aiohttp_app(app) as up, sidecar(tmp_path, up) as (port, admin, _):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(f"ws://127.0.0.1:{port}/ws")
        assert refused.value.response.status_code == 403
        assert refused.value.response.body == b"no sockets for you"
        assert metric(admin, "upgrades_total", route="ws", result="refused") == 1
        assert metric(admin, "upgrades_in_flight", route="ws") == 0


async def test_a_tunnel_idle_past_idle_timeout_is_cut(tmp_path: Path) -> None:
    route = "    upgrade: {idle_timeout: 300ms}\n"
    async with ws_echo_server() as up, sidecar(tmp_path, up, route=route) as (port, admin, _):
        async with websockets.connect(f"ws://127.0.0.1:{port}/", ping_interval=None) as ws:
            await ws.send("still here")
            assert await ws.recv() == "still here"
            await asyncio.wait_for(ws.wait_closed(), 15)  # nothing sent: the sidecar cuts it
        await until(
            lambda: metric(admin, "upgrades_total", route="ws", result="idle-timeout") == 1,
            "the cut counted",
        )
        assert metric(admin, "upgrades_in_flight", route="ws") == 0


async def test_a_client_gone_mid_tunnel_gives_back_the_tunnel_and_the_bulkhead(
    tmp_path: Path,
) -> None:
    """One bulkhead slot: the tunnel holds it; once its client vanishes (no close frame, a
    reset), the gauge is back at 0 and the next request gets the slot."""
    extra = "defaults: {bulkhead: {max_concurrent: 1, queue_timeout: 50ms, adaptive: false}}\n"
    async with ws_echo_server() as up, sidecar(tmp_path, up, extra) as (port, admin, _):
        ws = await websockets.connect(f"ws://127.0.0.1:{port}/", ping_interval=None)
        await ws.send("x")
        assert await ws.recv() == "x"
        busy = await raw_request(port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert b"x-retry-fate: overloaded" in busy  # the tunnel holds the one slot
        ws.transport.abort()  # gone, mid-tunnel
        await until(
            lambda: metric(admin, "upgrades_in_flight", route="ws") == 0, "the tunnel ended"
        )
        after = await raw_request(port, b"GET / HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n")
        assert b"x-retry-fate: overloaded" not in after and after.startswith(b"HTTP/1.1 426")


@pytest.mark.slow
async def test_sigterm_gives_open_tunnels_the_drain_time_then_closes_them(
    tmp_path: Path,
) -> None:
    async with (
        ws_echo_server() as up,
        sidecar(tmp_path, up, "drain_timeout: 1s\n") as (
            port,
            _,
            proc,
        ),
    ):
        async with websockets.connect(f"ws://127.0.0.1:{port}/", ping_interval=None) as ws:
            assert proc.proc is not None
            proc.proc.send_signal(signal.SIGTERM)
            await ws.send("during the drain")  # the tunnel still carries bytes
            assert await ws.recv() == "during the drain"
            await asyncio.wait_for(ws.wait_closed(), 15)  # then the drain ran out
        assert await asyncio.to_thread(proc.proc.wait, 15) == 0


async def test_enabled_false_sends_the_request_as_nginx_without_upgrade_config_would(
    tmp_path: Path,
) -> None:
    """No Upgrade upstream: the app answers the plain GET (the websockets server: 426)."""
    route = "    upgrade: {enabled: false}\n"
    async with ws_echo_server() as up, sidecar(tmp_path, up, route=route) as (port, admin, _):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await websockets.connect(f"ws://127.0.0.1:{port}/")
        assert refused.value.response.status_code == 426
        assert metric(admin, "upgrades_total", route="ws", result="refused") == 0


# -- upgrades the sidecar does not tunnel: h2c with a body, a refused upgrade -------------------


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


# -- h2c: never acted on, never tunnelled ------------------------------------------------------

H2C_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
# A SETTINGS frame, then a HEADERS frame for a path no route would serve (bytes as sent).
H2C_FRAMES = b"\x00\x00\x00\x04\x00\x00\x00\x00\x00" + b"\x00\x00\x05\x01\x04\x00\x00\x00\x01/adm"


def _h2c_upgrade(variant: str) -> bytes:
    version = b"HTTP/1.0" if variant == "http10" else b"HTTP/1.1"
    connection = b"Upgrade, HTTP2-Settings" + (b", close" if variant == "close" else b"")
    return (
        b"GET /h2c HTTP/1.1\r\nHost: t\r\nConnection: %s\r\nUpgrade: h2c\r\n"
        b"HTTP2-Settings: AAMAAABkAAQCAAAAAAIAAAAA\r\n\r\n" % connection
    ).replace(b"HTTP/1.1", version, 1)


@pytest.mark.parametrize("pipelined", (False, True), ids=("after-the-answer", "pipelined"))
@pytest.mark.parametrize("variant", ("keepalive", "close", "http10"))
async def test_no_http2_preface_reaches_the_upstream_after_an_h2c_upgrade(
    tmp_path: Path, variant: str, pipelined: bool
) -> None:
    """Issue 29 item 9, on raw sockets: an upstream that answers ``Upgrade: h2c`` with 101
    got the client's HTTP/2 preface and frames through the tunnel the sidecar opened. Now the
    upstream is asked without Upgrade (it answers 200) and no preface byte reaches it, whether
    the client sends it after the answer or pipelined behind the request, split at random
    byte boundaries."""
    received: list[bytes] = []

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        head = await read_head(r)
        received.append(head)
        if b"upgrade: h2c" in head.lower():
            w.write(
                b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: h2c\r\n\r\n"
            )
            await w.drain()
            while chunk := await r.read(65536):  # what a tunnel would carry
                received.append(chunk)
            return
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await w.drain()
        while chunk := await r.read(65536):
            received.append(chunk)

    rng = random.Random(f"{variant}-{pipelined}")
    request = _h2c_upgrade(variant)
    async with raw_server(upstream) as up, sidecar(tmp_path, up) as (port, _, _):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        try:
            data = request + (H2C_PREFACE + H2C_FRAMES if pipelined else b"")
            cuts = sorted({0, len(data), *rng.sample(range(1, len(data)), 6)})
            with contextlib.suppress(ConnectionError):  # HTTP/1.0: answered and closed
                for a, b in itertools.pairwise(cuts):
                    w.write(data[a:b])
                    await w.drain()
                    await asyncio.sleep(0.002)
            try:
                answer = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
            except (ConnectionError, asyncio.IncompleteReadError):
                # Answered and closed while the preface was still being written: the kernel
                # may reset the connection before the client reads the answer.
                assert pipelined and variant != "keepalive"
            else:
                assert answer.startswith((b"HTTP/1.1 200 ", b"HTTP/1.0 200 ")), answer
                assert b"upgrade" not in answer.lower()
            if not pipelined:
                with contextlib.suppress(ConnectionError):
                    w.write(H2C_PREFACE + H2C_FRAMES)
                    await w.drain()
            # The rest of the exchange: the sidecar refuses the preface as HTTP/1.1 (400) or
            # has closed the connection already (close, HTTP/1.0).
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(r.read(), 10)
        finally:
            w.close()
        await asyncio.sleep(0.2)  # anything a tunnel would carry has arrived by now
    upstream_bytes = b"".join(received)
    assert upstream_bytes.count(b"GET /h2c ") == 1
    assert (
        b"upgrade" not in upstream_bytes.lower() and b"http2-settings" not in upstream_bytes.lower()
    )
    assert b"PRI * HTTP/2.0" not in upstream_bytes and b"/adm" not in upstream_bytes

"""A drain (SIGTERM) with requests in flight, seen with real clients:

- an upload whose body was still arriving when the drain began was never read further
  (aiohttp reads nothing once a connection is closing): the request waited out the whole
  drain for bytes that never came, and the app never got it. nginx's graceful shutdown reads
  it and answers. The body of the request in flight is read; nothing after it is.
- a request that outlasts the drain was cut only at twice ``drain_timeout`` (aiohttp waits its
  timeout, cancels only the request's body, and waits again): the chart gives the pod
  ``2 x drain_timeout`` before SIGKILL. The drain's end now cancels every handler still running.
"""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from sidecar.proxy.server import GuardedRequestHandler, SidecarServer
from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port
from tests.wait import until


def chunk(b: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(b), b)


def variants(size: int) -> list[tuple[str, bytes, bytes, bytes]]:
    """(name, head, first half of the body as sent, the rest as sent)."""
    body = os.urandom(size)
    h = size // 2
    cl = b"Content-Length: %d\r\n\r\n" % size
    return [
        ("keep-alive", b"POST /up HTTP/1.1\r\nHost: t\r\n" + cl, body[:h], body[h:]),
        ("http/1.0", b"POST /up HTTP/1.0\r\n" + cl, body[:h], body[h:]),
        (
            "close",
            b"POST /up HTTP/1.1\r\nHost: t\r\nConnection: close\r\n" + cl,
            body[:h],
            body[h:],
        ),
        (
            "chunked",
            b"POST /up HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n",
            chunk(body[:h]),
            chunk(body[h:]) + b"0\r\n\r\n",
        ),
    ]


CASES = [(size, *v) for size in (20_000, 200_000) for v in variants(size)]


async def read_all(r: asyncio.StreamReader) -> bytes:
    out = b""
    async with asyncio.timeout(30):
        while chunk_ := await r.read(65536):
            out += chunk_
    return out


@pytest.mark.parametrize(
    ("size", "name", "head", "first", "rest"), CASES, ids=[f"{c[1]}-{c[0]}" for c in CASES]
)
async def test_an_upload_in_flight_when_a_drain_begins_is_read_whole_and_answered(
    upstream_factory, sidecar_factory, size, name, head, first, rest
):
    up = await upstream_factory(reply(200, b"stored"))
    sc = await sidecar_factory(routes_yaml(up.url, top_extra="drain_timeout: 20s"))
    server = sc.sidecar._proxy_runner.server
    assert isinstance(server, SidecarServer)
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(head + first)
    await w.drain()

    def conns() -> list[GuardedRequestHandler]:
        return [c for c in server.connections if isinstance(c, GuardedRequestHandler)]

    await until(lambda: any(c.in_request for c in conns()), "the request in flight")
    stop = asyncio.create_task(sc.sidecar.stop())
    await until(lambda: all(c.draining for c in conns()), "the drain to begin")
    w.write(rest)
    await w.drain()
    out = await read_all(r)
    w.close()
    await stop
    assert out.split(b"\r\n", 1)[0].endswith(b"200 OK"), out[:300]
    assert out.endswith(b"stored")
    sent = first + rest if name != "chunked" else None
    assert [len(s.body) for s in up.seen] == [size]
    if sent is not None:
        assert up.seen[0].body == sent


async def test_nothing_after_the_request_in_flight_is_read_once_a_drain_began(
    upstream_factory, sidecar_factory
):
    """The body of the request in flight is read; a request pipelined after it is not
    (the connection closes once the answer is sent)."""
    up = await upstream_factory(reply(200, b"ok"))
    sc = await sidecar_factory(routes_yaml(up.url, top_extra="drain_timeout: 20s"))
    server = sc.sidecar._proxy_runner.server
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"POST /a HTTP/1.1\r\nHost: t\r\nContent-Length: 4\r\n\r\nab")
    await w.drain()
    await until(lambda: any(c.in_request for c in server.connections), "the request in flight")
    stop = asyncio.create_task(sc.sidecar.stop())
    await until(lambda: all(c.draining for c in server.connections), "the drain to begin")
    w.write(b"cdGET /b HTTP/1.1\r\nHost: t\r\n\r\n")
    await w.drain()
    out = await read_all(r)
    w.close()
    await stop
    assert out.count(b"HTTP/1.1 200") == 1, out
    assert [(s.raw_path, s.body) for s in up.seen] == [("/a", b"abcd")]


async def test_the_drains_end_cancels_every_request_still_running(
    upstream_factory, sidecar_factory, monkeypatch
):
    """A request waiting on an upstream that never answers is cut when the drain ends: the
    runner calls ``SidecarServer.cut`` at ``drain_timeout``, which cancels the handler, whose
    scopes give everything back. (aiohttp alone cancelled only the request's body, which a
    handler waiting on the upstream never reads, and waited ``drain_timeout`` again.)"""
    seen_cut: list[float] = []
    real_cut = SidecarServer.cut

    def cut(self: SidecarServer) -> None:
        seen_cut.append(asyncio.get_running_loop().time())
        real_cut(self)

    monkeypatch.setattr(SidecarServer, "cut", cut)
    arrived = asyncio.Event()

    async def never(request: web.Request) -> web.StreamResponse:
        arrived.set()
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    up = await upstream_factory(never)
    sc = await sidecar_factory(routes_yaml(up.url, top_extra="drain_timeout: 200ms"))
    st = sc.sidecar.states.get("main")
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    w.write(b"GET /poll HTTP/1.1\r\nHost: t\r\n\r\n")
    await w.drain()
    await asyncio.wait_for(arrived.wait(), 10)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await sc.sidecar.stop()
    out = await read_all(r)
    w.close()
    assert out == b""  # cut: no answer was ever started
    assert len(seen_cut) == 1 and seen_cut[0] - began >= 0.2
    assert st.bulkhead.in_flight == 0


async def test_a_real_process_reads_a_streamed_upload_in_flight_at_sigterm(tmp_path: Path):
    """The same under uvloop, as shipped: SIGTERM while a streamed upload (over
    retry.max_body_bytes: the app has its head) is half sent; the rest follows once the
    sidecar says it is draining, and the app gets every byte."""
    got: list[int] = []
    started = asyncio.Event()

    async def take(request: web.Request) -> web.Response:
        started.set()
        got.append(len(await request.read()))
        return web.Response(text="stored")

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/up", take)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    app_port = int(runner.addresses[0][1])
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n'
        f"drain_timeout: 20s\n"
        f'routes:\n  - name: app\n    upstream: "http://127.0.0.1:{app_port}"\n'
    )
    proc = SidecarProcess(cfg)
    proc.start()
    try:
        await proc.wait_port(port, admin)
        _, head, first, rest = variants(400_000)[0]
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(head + first)
        await w.drain()
        await asyncio.wait_for(started.wait(), 10)
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        async with aiohttp.ClientSession() as client:

            async def draining() -> bool:
                async with client.get(f"http://127.0.0.1:{admin}/readyz") as resp:
                    return resp.status == 503

            for _ in range(500):
                if await draining():
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the sidecar never said it was draining")
        w.write(rest)
        await w.drain()
        out = await read_all(r)
        w.close()
        assert out.split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK", out[:300]
        assert got == [400_000]
    finally:
        proc.terminate()
        await runner.cleanup()

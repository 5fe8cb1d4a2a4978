"""bench/floor.py's two floor proxies relay what they claim to, as real processes on loopback,
and give back the upstream exchange when the client goes away half-way. No timing here: what
they cost is measured by bench/perf.py."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
from aiohttp import web

from bench.floor import start
from tests.conftest import Upstream
from tests.proc import free_port

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("aiohttp", "protocol")

UpstreamFactory = Callable[..., Awaitable[Upstream]]
Response = tuple[int, dict[bytes, bytes], bytes]


async def echo(request: web.Request) -> web.StreamResponse:
    """Status from ``?status=``; the body says what arrived; a hop-by-hop header is added."""
    status = int(request.query.get("status", "200"))
    seen = f"{request.path_qs} in={request.headers.get('X-In')} secret={request.headers.get('X-Secret')}"
    return web.Response(
        status=status,
        body=b"" if status == 204 else seen.encode(),
        headers={"X-Up": request.path, "Connection": "x-hop", "X-Hop": "must not pass"},
    )


class FloorProcess:
    """``python -m bench.floor KIND`` as a real process, stopped by PID."""

    def __init__(self, kind: str, upstream: int) -> None:
        self.port = free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.floor",
                kind,
                "--listen",
                str(self.port),
                "--upstream",
                str(upstream),
            ],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": os.pathsep.join(
                    filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
                ),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    async def wait_port(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise RuntimeError(f"floor proxy exited with {self.proc.returncode}: {err}")
            try:
                _, w = await asyncio.open_connection("127.0.0.1", self.port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise TimeoutError(f"floor proxy did not listen on {self.port}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@pytest.fixture
async def floor_process() -> AsyncIterator[Callable[[str, int], Awaitable[FloorProcess]]]:
    started: list[FloorProcess] = []

    async def make(kind: str, upstream: int) -> FloorProcess:
        fp = FloorProcess(kind, upstream)
        started.append(fp)
        await fp.wait_port()
        return fp

    yield make
    for fp in started:
        fp.stop()


async def get(
    r: asyncio.StreamReader, w: asyncio.StreamWriter, target: bytes, extra: bytes = b""
) -> Response:
    """One GET on an open connection; the response framed by its Content-Length."""
    w.write(b"GET " + target + b" HTTP/1.1\r\nHost: floor.test\r\n" + extra + b"\r\n")
    await w.drain()
    head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    lines = head[:-4].split(b"\r\n")
    status = int(lines[0].split()[1])
    headers = {}
    for line in lines[1:]:
        k, v = line.split(b":", 1)
        headers[k.strip().lower()] = v.strip()
    body = await r.readexactly(int(headers.get(b"content-length", b"0")))
    return status, headers, body


@pytest.mark.parametrize("kind", KINDS)
async def test_relays_status_headers_and_body_over_one_keepalive_connection(
    kind: str,
    upstream_factory: UpstreamFactory,
    floor_process: Callable[..., Awaitable[FloorProcess]],
) -> None:
    up = await upstream_factory(echo)
    fp = await floor_process(kind, up.port)
    r, w = await asyncio.open_connection("127.0.0.1", fp.port)
    try:
        # The client names X-Secret hop-by-hop: it must not reach the upstream.
        extra = b"X-In: hello\r\nConnection: keep-alive, X-Secret\r\nX-Secret: s3\r\n"
        for i, status in enumerate((200, 201, 404, 204, 503, 200)):
            target = f"/item/{i}?status={status}".encode()
            got_status, headers, body = await get(r, w, target, extra)
            assert got_status == status
            assert headers[b"x-up"] == f"/item/{i}".encode()
            assert b"x-hop" not in headers  # named by the upstream's Connection header
            assert headers.get(b"connection", b"keep-alive").lower() != b"close"
            if status == 204:
                assert body == b""
            else:
                assert body == f"/item/{i}?status={status} in=hello secret=None".encode()
        # Every request came over the same client connection, and reached the upstream once.
        assert [s.raw_path for s in up.seen] == [
            f"/item/{i}?status={s}" for i, s in enumerate((200, 201, 404, 204, 503, 200))
        ]
        assert all(s.header("Host") == "floor.test" for s in up.seen)
        # GET only, said plainly; the connection stays usable after it.
        w.write(b"POST /x HTTP/1.1\r\nHost: floor.test\r\nContent-Length: 3\r\n\r\nabc")
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 501 ")
        length = next(
            int(line.split(b":", 1)[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        assert b"GET only" in await r.readexactly(length)
        status, _, body = await get(r, w, b"/after?status=200")
        assert (status, body) == (200, b"/after?status=200 in=None secret=None")
        assert len(up.seen) == 7  # the POST was never sent upstream
    finally:
        w.close()
    assert fp.stop() == 0  # SIGTERM: a clean shutdown


@pytest.mark.parametrize("kind", KINDS)
async def test_upstream_down_is_a_502(
    kind: str, floor_process: Callable[..., Awaitable[FloorProcess]]
) -> None:
    fp = await floor_process(kind, free_port())  # nothing listens there
    r, w = await asyncio.open_connection("127.0.0.1", fp.port)
    try:
        status, _, body = await get(r, w, b"/")
        assert status == 502
        assert b"ConnectFailure" in body
    finally:
        w.close()


@pytest.mark.parametrize("phase", ["head", "body"])
@pytest.mark.parametrize("kind", KINDS)
async def test_client_gone_half_way_gives_the_upstream_exchange_back(
    kind: str, phase: str, upstream_factory: UpstreamFactory
) -> None:
    """The client disconnects while the floor waits for the upstream's head, or for the rest
    of its body: the exchange is cancelled, the upstream connection dropped (not pooled with
    half a body in it, not leaked), and the upstream's handler sees the disconnect."""
    started = asyncio.Event()
    upstream_cancelled = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        started.set()
        try:
            if phase == "body":
                resp = web.StreamResponse(headers={"Content-Length": "10"})
                await resp.prepare(request)
                await resp.write(b"abc")  # 3 of 10 bytes, then nothing
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            upstream_cancelled.set()
            raise
        return web.Response(text="late")

    up = await upstream_factory(stall)
    floor = await start(kind, 0, up.port)
    try:
        _, w = await asyncio.open_connection("127.0.0.1", floor.port)
        w.write(b"GET /stall HTTP/1.1\r\nHost: floor.test\r\n\r\n")
        await w.drain()
        await asyncio.wait_for(started.wait(), 10)
        key = f"127.0.0.1:{up.port}"
        assert floor.client.stats()[key].total == 1  # the exchange holds one connection
        await asyncio.sleep(0.2)  # the head (and the 3 bytes) reach the floor
        w.close()
        async with asyncio.timeout(10):
            while floor.client.stats()[key].total != 0:
                await asyncio.sleep(0.02)
            await upstream_cancelled.wait()
        assert floor.client.stats()[key].idle == 0
    finally:
        await floor.close()


@pytest.mark.parametrize("kind", KINDS)
async def test_shutdown_with_a_request_in_flight_gives_everything_back(
    kind: str, upstream_factory: UpstreamFactory
) -> None:
    started = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        started.set()
        await asyncio.sleep(30)
        return web.Response(text="late")

    up = await upstream_factory(stall)
    floor = await start(kind, 0, up.port)
    r, w = await asyncio.open_connection("127.0.0.1", floor.port)
    try:
        w.write(b"GET /stall HTTP/1.1\r\nHost: floor.test\r\n\r\n")
        await w.drain()
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.wait_for(floor.close(), 10)
        assert floor.client.stats()[f"127.0.0.1:{up.port}"].total == 0
        # The client is not left hanging: its connection is closed (read() returns at EOF;
        # it would time out otherwise), with no answer the upstream never gave.
        rest = await asyncio.wait_for(r.read(), 10)
        assert b"late" not in rest
    finally:
        w.close()

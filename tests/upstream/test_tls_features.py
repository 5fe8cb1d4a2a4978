"""The rest of the sidecar over TLS to an ``https://`` upstream (nginx with ``ssl``,
``tests/tlspeers.py``), through the real process: a write captured in the DLQ and replayed over
TLS with the route's settings, the idempotency guard, a WebSocket upgrade tunnelled over the
TLS connection, and a drain."""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import threading
from collections.abc import Iterator

import pytest
import websockets

from tests import tlspeers
from tests.proc import free_port, launched
from tests.tlspeers import World

pytestmark = pytest.mark.skipif(shutil.which("nginx") is None, reason="nginx is not installed")


class EchoServer:
    """A plaintext WebSocket echo server (the websockets package) in a thread of its own, for
    nginx to proxy /upgrade to."""

    def __init__(self) -> None:
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _run(self) -> None:
        async def echo(ws: websockets.ServerConnection) -> None:
            async for message in ws:
                await ws.send(message)

        async with websockets.serve(echo, "127.0.0.1", 0) as server:
            self.port = next(iter(server.sockets)).getsockname()[1]
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            self._ready.set()
            await self._stop.wait()

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    root = tmp_path_factory.mktemp("tls-features")
    echo = EchoServer()
    peers = tlspeers.start(root / "nginx", ws_port=echo.port)
    port, admin = free_port(), free_port()
    up = f"https://localhost:{peers.ports['ok']}"
    tls = f"{{ca_file: {peers.certs.ca}}}"
    cfg = root / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n'
        f'dlq: {{path: "{root}/dlq.sqlite3"}}\n'
        f'idempotency: {{path: "{root}/keys.sqlite3"}}\n'
        "defaults:\n  retry: {backoff: {strategy: constant, base: 1ms, max: 1ms}}\n"
        f"  tls: {tls}\n"
        "routes:\n"
        f'  - name: dlq\n    match: {{path_prefix: /dlq/}}\n    upstream: "{up}"\n'
        "    dlq: {enabled: true}\n"
        f'  - name: idem\n    match: {{path_prefix: /idem/}}\n    upstream: "{up}"\n'
        "    idempotency: {enabled: true}\n"
        f'  - name: ws\n    match: {{path_prefix: /upgrade}}\n    upstream: "{up}"\n'
    )
    try:
        proc = asyncio.run(launched(cfg, port, admin))
    except BaseException:
        peers.close()
        echo.close()
        raise
    try:
        yield World(peers, proc, port, admin)
    finally:
        proc.terminate()
        peers.close()
        echo.close()


def request(
    port: int,
    method: str,
    target: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
    try:
        c.request(method, target, body=body, headers=headers or {})
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def test_a_write_is_captured_and_replayed_over_tls(world: World) -> None:
    world.peers.new_lines("ok")
    status, headers, _ = request(
        world.port, "POST", "/dlq/orders", b'{"a": 1}', {"Content-Type": "application/json"}
    )
    assert status == 503 and "x-retry-dlq-id" in headers, headers
    rid = headers["x-retry-dlq-id"]
    status, _, body = request(world.admin, "POST", f"/dlq/{rid}/replay")
    assert status == 200, body
    out = json.loads(body)
    assert out["status"] == "delivered" and out["http_status"] == 201, out
    lines = [ln for ln in world.peers.new_lines("ok") if "/dlq/orders" in ln]
    assert len(lines) == 2 and all("sni=localhost" in ln for ln in lines), lines  # sent, replayed


def test_the_idempotency_guard_over_tls(world: World) -> None:
    world.peers.new_lines("ok")
    key = {"Idempotency-Key": "tls-order-1"}
    first = request(world.port, "POST", "/idem/pay", b"pay", key)
    again = request(world.port, "POST", "/idem/pay", b"pay", key)
    assert first[0] == again[0] == 201
    assert first[2] == again[2]  # the kept answer replayed
    assert len([ln for ln in world.peers.new_lines("ok") if "/idem/pay" in ln]) == 1


def test_a_websocket_upgrade_to_an_https_upstream(world: World) -> None:
    async def talk() -> list[str]:
        got = []
        async with websockets.connect(f"ws://127.0.0.1:{world.port}/upgrade") as ws:
            for word in ("one", "two", "x" * 100_000):
                await ws.send(word)
                got.append(str(await ws.recv()))
        return got

    assert asyncio.run(talk()) == ["one", "two", "x" * 100_000]
    lines = [ln for ln in world.peers.new_lines("ok") if "/upgrade" in ln]
    assert lines and "sni=localhost" in lines[-1]

"""Fixtures: real aiohttp upstream servers and a real sidecar on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.app import Sidecar
from sidecar.config.parse import parse_text
from sidecar.telemetry.events import Recorder

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Seen:
    method: str
    raw_path: str
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None

    def all(self, name: str) -> list[str]:
        return [v for k, v in self.headers if k.lower() == name.lower()]


@dataclass
class Upstream:
    """A scripted upstream: each request is answered by the next handler in ``script``
    (the last one repeats), and recorded in ``seen``."""

    port: int = 0
    seen: list[Seen] = field(default_factory=list)
    script: list[Handler] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.seen.append(
            Seen(
                request.method,
                request.raw_path,
                [(k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers],
                body,
            )
        )
        i = min(len(self.seen) - 1, len(self.script) - 1)
        return await self.script[i](request)


def reply(status: int = 200, body: bytes = b"ok", headers: dict[str, str] | None = None) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        return web.Response(status=status, body=body, headers=headers)

    return h


def hang(seconds: float = 30.0) -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        await asyncio.sleep(seconds)
        return web.Response(text="late")

    return h


def reset() -> Handler:
    async def h(request: web.Request) -> web.StreamResponse:
        assert request.transport is not None
        request.transport.abort()
        return web.Response(status=500)

    return h


@pytest.fixture
async def upstream_factory() -> AsyncIterator[Callable[..., Awaitable[Upstream]]]:
    runners: list[web.AppRunner] = []

    async def make(*script: Handler) -> Upstream:
        up = Upstream(script=list(script) or [reply()])
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", up.handle)
        # auto_decompress off so the test sees exactly what the sidecar sent.
        runner = web.AppRunner(
            app,
            access_log=None,
            auto_decompress=False,
            handler_cancellation=True,
            shutdown_timeout=0.2,
        )
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        up.port = int(runner.addresses[0][1])
        runners.append(runner)
        return up

    yield make
    for r in runners:
        await r.cleanup()


@dataclass
class Running:
    sidecar: Sidecar
    recorder: Recorder

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sidecar.proxy_port}"


def routes_yaml(
    upstream_url: str,
    route_extra: str = "",
    top_extra: str = "",
    admin: str = 'admin: {listen: "127.0.0.1:0"}',
) -> str:
    return f"""
version: 1
name: test-edge
listen: "127.0.0.1:0"
{admin}
{top_extra}
defaults:
  retry:
    backoff: {{strategy: constant, base: 1ms, max: 1ms}}
routes:
  - name: main
    upstream: "{upstream_url}"
{route_extra}
"""


@pytest.fixture
async def sidecar_factory() -> AsyncIterator[Callable[..., Awaitable[Running]]]:
    started: list[Sidecar] = []

    async def make(yaml_text: str, **kwargs: Any) -> Running:
        sc = Sidecar(parse_text(yaml_text, "<test>"), **kwargs)
        rec = Recorder()
        sc.add_sink(rec)
        await sc.start()
        started.append(sc)
        return Running(sc, rec)

    yield make
    for sc in started:
        await sc.stop()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(
        auto_decompress=False, timeout=aiohttp.ClientTimeout(total=30)
    ) as s:
        yield s

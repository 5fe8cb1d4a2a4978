"""Wiring: listeners, shared state, lifecycle."""

from __future__ import annotations

import logging
import random

from aiohttp import web

from sidecar.config.model import Config
from sidecar.config.store import ConfigStore
from sidecar.proxy.handler import ProxyDeps, ProxyHandler
from sidecar.retry.loop import Clock, RetryGate
from sidecar.telemetry.events import EventSink, Fanout
from sidecar.upstream.client import UpstreamClient
from sidecar.upstream.pool import PoolSettings

log = logging.getLogger("sidecar")


def c_parser_in_use() -> bool:
    """aiohttp's C HTTP parser rejects request-smuggling shapes its Python fallback has let by."""
    from aiohttp import http_parser

    return http_parser.HttpRequestParser.__module__ == "aiohttp._http_parser"


class Sidecar:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        pool: PoolSettings | None = None,
    ) -> None:
        self.store = ConfigStore(config)
        self.clock = clock or Clock()
        self.events = Fanout()
        self.gate = RetryGate()
        self.client = UpstreamClient(pool)
        self.deps = ProxyDeps(
            store=self.store,
            client=self.client,
            clock=self.clock,
            rng=rng or random.Random(),
            events=self.events,
            gate=self.gate,
        )
        self._proxy_runner: web.ServerRunner | None = None
        self.proxy_port = 0

    def add_sink(self, sink: EventSink) -> None:
        self.events.sinks.append(sink)

    async def start(self) -> None:
        config = self.store.current
        server = web.Server(
            ProxyHandler(self.deps),
            auto_decompress=False,  # bodies pass through byte-identical (DESIGN.md section 8)
            access_log=None,
        )
        runner = web.ServerRunner(server, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, config.listen.host, config.listen.port, reuse_address=True)
        await site.start()
        self._proxy_runner = runner
        addr = runner.addresses[0]
        self.proxy_port = int(addr[1])
        log.info("proxy listening on %s:%d", config.listen.host, self.proxy_port)

    async def stop(self) -> None:
        if self._proxy_runner is not None:
            await self._proxy_runner.cleanup()
            self._proxy_runner = None
        self.client.close()

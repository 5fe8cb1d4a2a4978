"""Wiring: listeners, shared state, lifecycle."""

from __future__ import annotations

import logging
import random

from aiohttp import web

from sidecar.admin.killswitch import KillSwitch
from sidecar.config.model import Config
from sidecar.config.store import ConfigStore
from sidecar.lifecycle import Lifecycle
from sidecar.proxy.handler import ProxyDeps, ProxyHandler
from sidecar.retry.breaker import State
from sidecar.retry.loop import Clock
from sidecar.retry.routestate import RouteStates
from sidecar.telemetry.events import BreakerTransitioned, EventSink, Fanout
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
        self.states = RouteStates(self._on_breaker_transition)
        self.states.sync(config)
        self.kill = KillSwitch()
        self.life = Lifecycle()
        self.client = UpstreamClient(pool)
        self.deps = ProxyDeps(
            store=self.store,
            client=self.client,
            clock=self.clock,
            rng=rng or random.Random(),
            events=self.events,
            states=self.states,
            kill=self.kill,
            life=self.life,
        )
        self._proxy_runner: web.ServerRunner | None = None
        self.proxy_port = 0

    def _on_breaker_transition(self, route: str, frm: State, to: State) -> None:
        log.warning("breaker of route %s: %s -> %s", route, frm.value, to.value)
        self.events.breaker_transitioned(BreakerTransitioned(route, frm.value, to.value))

    def add_sink(self, sink: EventSink) -> None:
        self.events.sinks.append(sink)

    def apply(self, config: Config) -> None:
        """Swap in a new, already validated config. Route state is kept by name."""
        self.states.sync(config)
        self.store.swap(config)

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
        self.life.ready = True
        log.info("proxy listening on %s:%d", config.listen.host, self.proxy_port)

    async def stop(self) -> None:
        self.life.start_drain()
        if self._proxy_runner is not None:
            await self._proxy_runner.cleanup()
            self._proxy_runner = None
        self.client.close()

"""Wiring: listeners, shared state, background tasks, lifecycle and drain."""

from __future__ import annotations

import asyncio
import logging
import os
import random
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sidecar.admin.auth import FailedLogins, check_exposure, token_from_env
from sidecar.admin.gauges import wire_gauges
from sidecar.admin.killswitch import KillSwitch, apply_file
from sidecar.admin.listener import AdminRunner
from sidecar.admin.page import PageDeps, page_routes
from sidecar.admin.rates import RateSampler
from sidecar.admin.server import AdminDeps, build_admin_app
from sidecar.admin.snapshot import StatusSources
from sidecar.config.model import Config
from sidecar.config.store import ConfigStore
from sidecar.config.watch import Reloader, ReloadResult
from sidecar.core import Clock
from sidecar.dlq.admin import dlq_routes
from sidecar.dlq.figures import DlqFigures
from sidecar.dlq.service import DlqService
from sidecar.engine.figures import RouteFigureSource
from sidecar.engine.resolve import Resolver
from sidecar.engine.routestate import RouteStates
from sidecar.fleet.links import FleetLinks
from sidecar.fleet.switches import TASK as FLEET_SWITCHES
from sidecar.fleet.switches import FleetSwitches
from sidecar.heaptrim import HeapTrimmer
from sidecar.idempotency import service as keys
from sidecar.idempotency.admin import idempotency_routes
from sidecar.idempotency.durability import Checkpointed, sync_forever
from sidecar.idempotency.outcome import IdempotencyOutcome
from sidecar.idempotency.prune import prune_forever
from sidecar.jsonapi import ExtraRoute
from sidecar.lifecycle import Lifecycle
from sidecar.proxy.certreload import RELOAD_RESULTS, CertReloader
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.h2listen import DualServer
from sidecar.proxy.handler import ProxyHandler
from sidecar.proxy.respond import client_error
from sidecar.proxy.runner import DrainingRunner
from sidecar.proxy.server import SidecarServer
from sidecar.proxy.tlslisten import RESULTS, SwitchingContext, TlsSite, listener_reports
from sidecar.proxy.tunnel import Tunnels
from sidecar.retry.breaker import State
from sidecar.telemetry.events import BreakerTransitioned, EventSink, Fanout
from sidecar.telemetry.metrics import Metrics
from sidecar.telemetry.requestlog import RequestLog
from sidecar.telemetry.tracing import Tracing
from sidecar.upstream.client import UpstreamClient
from sidecar.upstream.pool import PoolSettings
from sidecar.upstream.tls import HANDSHAKE_RESULTS, TlsContexts, tls_sections

if TYPE_CHECKING:
    # The DLQ's store and replayer (and sqlite3 or redis with them) are imported when a DLQ
    # opens (dlq/service.py), not at start: a sidecar with no DLQ route never loads them.
    from sidecar.dlq.contract import DlqStorage
    from sidecar.dlq.replay import Replayer
    from sidecar.idempotency.store import IdempotencyStore

log = logging.getLogger("sidecar")


class Sidecar:
    def __init__(
        self,
        config: Config,
        *,
        clock: Clock | None = None,
        rng: random.Random | None = None,
        pool: PoolSettings | None = None,
        config_path: str | None = None,
        tracing: Tracing | None = None,
        watch_interval: float = 0.5,
    ) -> None:
        self.store = ConfigStore(config)
        self.clock = clock or Clock()
        self.events = Fanout()
        self.metrics = Metrics()
        self.request_log = RequestLog(lambda: self.store.current.telemetry.access_log)
        self.events.sinks.extend((self.metrics, self.request_log))
        self.states = RouteStates(self._on_breaker_transition)
        self.states.sync(config)
        self._declare_routes(config)
        self.resolver = Resolver(self.states)
        self.figures = RouteFigureSource(self.states, lambda: self.store.current)
        # Every use's link to the fleet's Redis, one view for the gauge and the status page.
        self.fleet_links = FleetLinks()
        fleet = FleetSwitches.of(config.fleet, self.clock, self.fleet_links)
        self.kill = KillSwitch(self.clock.wall, fleet)
        apply_file(self.kill, config, self.clock.monotonic(), self.clock.wall())
        self.life = Lifecycle()
        self.kill.on_set(self.life.nudge_sleepers)
        self.client = UpstreamClient(
            pool or config.upstream_pool,
            TlsContexts(
                lambda result: self.metrics.tls_handshakes.inc(
                    (("side", "upstream"), ("result", result))
                )
            ),
        )
        self.client.sync_tls(tls_sections(config))
        self.tracing = tracing or Tracing(None)
        self.deps = ProxyDeps(
            store=self.store,
            client=self.client,
            clock=self.clock,
            rng=rng or random.Random(),
            events=self.events,
            states=self.states,
            kill=self.kill,
            life=self.life,
            tracing=self.tracing,
            malformed=lambda reason: self.metrics.malformed.inc((("reason", reason),)),
            refused=self.request_log.refused,
            dlq_write=lambda route, result: self.metrics.dlq_writes.inc(
                (("route", route), ("result", result))
            ),
            tunnels=Tunnels(
                lambda route, result: self.metrics.upgrades.inc(
                    (("route", route), ("result", result))
                )
            ),
            idempotency_result=lambda route, result: self.metrics.idempotency.inc(
                (("route", route), ("result", result))
            ),
        )
        # The idempotency store: opened once a route enables idempotency (restart-only keys).
        self.keys = keys.KeyStoreService(config, self.clock, self._keys_opened, self.fleet_links)
        self.reloader = (
            Reloader(config_path, self.store, self.apply, self._on_reload) if config_path else None
        )
        self.watch_interval = watch_interval
        self.admin_extra: list[ExtraRoute] = []
        # The DLQ: its backend and file are the ones the process started with (restart-only),
        # even when a reload is what first enables a DLQ route and opens it.
        self.dlqs = DlqService(
            config,
            self.deps,
            lambda: self.store.current,
            spawn=self.spawn,
            on_open=self._dlq_opened,
            recreated=lambda: self.metrics.dlq_file_recreated.inc(()),
            links=self.fleet_links,
        )
        self.certs: CertReloader | None = None  # the TLS listener's pair, when it has one
        self._proxy_server: SidecarServer | None = None
        self._proxy_runner: web.ServerRunner | None = None
        self._admin_runner: web.AppRunner | None = None
        self._tasks: dict[str, asyncio.Task[Any]] = {}
        self.proxy_port = 0
        self.admin_port = 0
        wire_gauges(
            self.metrics,
            figures=self.figures,
            store=self.store,
            kill=self.kill,
            clock=self.clock,
            dlq=lambda: self.dlqs.store,
            tunnels=self.deps.tunnels,
            fleet=self.fleet_links,
        )
        self.rates = RateSampler(self.metrics, self.clock)  # for the status page
        self.heap = HeapTrimmer()
        self.status = StatusSources(
            store=self.store,
            reloader=self.reloader,
            kill=self.kill,
            figures=self.figures,
            metrics=self.metrics,
            clock=self.clock,
            life=self.life,
            rates=self.rates,
            stats=self.process_stats,
            dlq=DlqFigures(lambda: self.dlqs.store, self.dlqs.location, lambda: self.dlqs.warning),
            fleet=self.fleet_links,
            idempotency_warning=lambda: self.keys.warning,
            tls_listener=lambda wall: (
                None if self.certs is None else self.certs.certs.as_json(wall)
            ),
            started_mono=self.clock.monotonic(),
            started_wall=self.clock.wall(),
        )

    @property
    def dlq(self) -> DlqStorage | None:
        return self.dlqs.store

    @property
    def replayer(self) -> Replayer | None:
        return self.dlqs.replayer

    # -- state hooks -------------------------------------------------------------------------

    def _dlq_opened(self, store: DlqStorage) -> None:
        # A first deletion of the file (SQLite), or a Redis that lost the DLQ's data, shows
        # in increase().
        self.metrics.dlq_file_recreated.values.setdefault((), 0.0)
        self.deps.dlq = store

    def _on_breaker_transition(self, route: str, frm: State, to: State) -> None:
        log.warning("breaker of route %s: %s -> %s", route, frm.value, to.value)
        self.events.breaker_transitioned(BreakerTransitioned(route, frm.value, to.value))

    def _on_reload(self, result: ReloadResult) -> None:
        self.metrics.reload_ok.set((), 1.0 if result.ok else 0.0)
        if result.ok:
            self.metrics.reload_ts.set((), self.clock.wall())

    def _declare_routes(self, config: Config) -> None:
        self.metrics.declare_routes((r.name, r.dlq.enabled) for r in config.routes)
        if tls_sections(config):
            for result in HANDSHAKE_RESULTS:
                self.metrics.tls_handshakes.values.setdefault(
                    (("side", "upstream"), ("result", result)), 0.0
                )
        self.metrics.declare_idempotency(
            (r.name for r in config.routes if r.idempotency.enabled),
            (o.value for o in IdempotencyOutcome),
        )

    def _keys_opened(self, store: IdempotencyStore) -> None:
        self.deps.idempotency, self.deps.holdings = store, self.keys.holdings
        self.spawn("idempotency-prune", prune_forever(store))
        if isinstance(store, Checkpointed):  # the SQLite file (Redis keeps its own durability)
            self.spawn("idempotency-sync", sync_forever(store))
        else:  # the fleet's Redis: may it evict keys?
            self.spawn("idempotency-redis-check", self.keys.check_redis())

    def _open_keys(self) -> None:
        if "idempotency-open" not in self._tasks:
            self.spawn("idempotency-open", self.keys.keep_opening(lambda: self.life.draining))

    def add_sink(self, sink: EventSink) -> None:
        self.events.sinks.append(sink)

    def apply(self, config: Config) -> None:
        """Swap in a new, already validated config, all or nothing: should any part of it
        fail, what was live before (config, route policies, file kill switches, DLQ bounds)
        is put back before the error goes on to the caller, which reports it."""
        old = self.store.current
        loaded = self.store.loaded
        file_switches = self.kill.file_state()
        try:
            self._apply(config)
        except Exception:
            self.client.sync_tls(tls_sections(old))
            self.states.sync(old)
            self.store.restore(old, loaded)
            self.kill.restore_file(file_switches)
            if self.dlqs.store is not None:
                self.dlqs.store.set_limits(old.dlq.max_records, old.dlq.max_bytes)
            raise

    def _apply(self, config: Config) -> None:
        """Route state is kept by name; the DLQ's bounds apply to the next record;
        drain_timeout to the next drain. A reload that is the first to enable a DLQ route
        opens the DLQ file (the one the process started with)."""
        self.client.sync_tls(tls_sections(config))  # first: a file gone bad changes nothing
        self.states.sync(config)
        self._declare_routes(config)
        self.store.swap(config)
        apply_file(self.kill, config, self.clock.monotonic(), self.clock.wall())
        self.dlqs.applied(config)
        if keys.wanted(config) and self.keys.store is None and self.dlqs.started:
            self._open_keys()  # started (not a reload before start)

    def spawn(self, name: str, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Start a named background task that is kept and cancelled on shutdown."""
        task = asyncio.create_task(coro, name=name)
        self._tasks[name] = task
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        if self._tasks.get(task.get_name()) is task:
            del self._tasks[task.get_name()]
        if not task.cancelled() and task.exception() is not None:
            log.error("background task %s failed: %r", task.get_name(), task.exception())

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        config = self.store.current
        token = token_from_env(config.admin)
        check_exposure(config.admin, token)
        await self.dlqs.start()
        if keys.wanted(config) and not await self.keys.open(lambda: self.life.draining):
            self._open_keys()
        # The DLQ endpoints exist even when no DLQ is open (they answer 503 then).
        self.admin_extra.extend(dlq_routes(self.dlqs.opened, self.dlqs.location))
        self.admin_extra.extend(idempotency_routes(lambda: self.keys.store))

        server = DualServer(
            ProxyHandler(self.deps),
            header_timeout=lambda: self.store.current.limits.header_timeout,
            send_timeout=lambda: self.store.current.limits.send_timeout,
            # A client that goes away cancels its handler: no attempt, backoff or Retry-After
            # wait runs for nobody (nginx's proxy_ignore_client_abort off).
            handler_cancellation=True,
            on_malformed=self.deps.malformed,
            refuse=self._refuse_unparsed,
            auto_decompress=False,  # bodies pass through byte-identical, gzip stays gzip
            access_log=None,
            keepalive_timeout=config.limits.keepalive_timeout,
        )
        runner = DrainingRunner(server, lambda: self.store.current.drain_timeout)
        await runner.setup()
        tls = self._listener_tls(config)
        site = (
            web.TCPSite(runner, config.listen.host, config.listen.port, reuse_address=True)
            if tls is None
            else TlsSite(
                runner,
                config.listen.host,
                config.listen.port,
                ssl_context=tls,
                reuse_address=True,
                handshake_timeout=config.limits.header_timeout,
            )
        )
        await site.start()
        self._proxy_server = server
        self._proxy_runner = runner
        self.proxy_port = int(runner.addresses[0][1])

        failed_login = FailedLogins(
            lambda via: self.metrics.admin_auth_failures.inc((("via", via),))
        )
        page_gets, page_forms = page_routes(
            PageDeps(self.status, token, lambda: self.dlqs.replayer, failed_login=failed_login)
        )
        admin_app = build_admin_app(
            AdminDeps(
                store=self.store,
                reloader=self.reloader,
                kill=self.kill,
                figures=self.figures,
                metrics=self.metrics,
                life=self.life,
                clock=self.clock,
                token=token,
                stats=self.process_stats,
                failed_login=failed_login,
            ),
            self.admin_extra + page_gets,
            page_forms,
        )
        arunner = AdminRunner(
            admin_app,
            header_timeout=lambda: self.store.current.limits.header_timeout,
            send_timeout=lambda: self.store.current.limits.send_timeout,
            keepalive_timeout=config.limits.keepalive_timeout,
            shutdown_timeout=1.0,
        )
        await arunner.setup()
        asite = web.TCPSite(
            arunner, config.admin.listen.host, config.admin.listen.port, reuse_address=True
        )
        try:
            await asite.start()
        except OSError:
            await runner.cleanup()
            await arunner.cleanup()
            raise
        self._admin_runner = arunner
        self.admin_port = int(arunner.addresses[0][1])

        self.spawn("status-rates", self.rates.run())
        if self.kill.fleet is not None:  # fleet.killswitch: the fleet's switches followed
            self.spawn(FLEET_SWITCHES, self.kill.fleet.run())
        self.spawn("heap-trim", self.heap.run())  # RSS back down after large bodies
        if config.fleet.redis.url is not None:  # a link shown unreachable is asked again
            self.spawn("fleet-probe", self.fleet_links.probe_forever())
        if self.reloader is not None:
            self.spawn("config-watch", self.reloader.watch(self.watch_interval))
        if self.certs is not None and tls is not None:  # the listener's pair re-read
            self.spawn("tls-reload", self.certs.watch(tls.install))
        self.spawn(
            "dns-refresh",
            self.resolver.watch(
                lambda: self.store.current, lambda: self.store.current.upstream_pool.dns_refresh
            ),
        )
        self.life.ready = True
        log.info(
            "proxy listening on %s:%d, admin on %s:%d, %d routes",
            config.listen.host,
            self.proxy_port,
            config.admin.listen.host,
            self.admin_port,
            len(config.routes),
        )

    def _listener_tls(self, config: Config) -> SwitchingContext | None:
        """The TLS listener's context (``server_tls``), its handshakes and reloads counted; a
        warning when its certificate expires within 14 days. None: the listener is plaintext."""
        if not config.server_tls.enabled:
            return None
        m = self.metrics
        for result in RESULTS:
            m.tls_handshakes.values.setdefault((("side", "listener"), ("result", result)), 0.0)
        for result in RELOAD_RESULTS:
            m.tls_reloads.values.setdefault((("result", result),), 0.0)
        self.certs = CertReloader(
            config.server_tls,
            wall=self.clock.wall,
            reloaded=lambda result: m.tls_reloads.inc((("result", result),)),
            expiry=lambda left: m.tls_cert_expiry.set((("use", "listener"),), left),
            prepare=listener_reports(
                lambda result: m.tls_handshakes.inc((("side", "listener"), ("result", result)))
            ),
        )
        warning = self.certs.expiry_warning()
        if warning is not None:
            log.warning("%s", warning)
        return SwitchingContext(self.certs.context)

    async def reload(self, trigger: str) -> ReloadResult | None:
        if self.reloader is None:
            return None
        return await self.reloader.reload(trigger)

    async def stop(self) -> None:
        """Drain: not ready at once, no new connections, in-flight requests (backoff sleeps
        cut short to one final attempt) get up to drain_timeout, then everything closes."""
        self.life.start_drain()
        drain = self.store.current.drain_timeout
        log.info("draining (up to %.1fs)", drain)
        loop = asyncio.get_running_loop()
        drain_ends = loop.time() + drain
        if self._proxy_runner is not None:
            await self._proxy_runner.cleanup()
            self._proxy_runner = None
        redrive = self._tasks.get("dlq-redrive")
        if redrive is not None:
            # The redrive starts no replay once draining and ends by itself; the replay in
            # flight finishes like an in-flight request (within the same drain time) and its
            # outcome is recorded. Cancelled half-way, a replay whose answer came but was not
            # recorded would be sent again after the restart.
            await asyncio.wait({redrive}, timeout=max(0.0, drain_ends - loop.time()))
        # Guarded writes whose client left run on like requests in flight, within the drain;
        # cancelled after it, their keys stay in progress until their lease (proxy/detached.py).
        await self.deps.detached.stop(drain_ends - loop.time())
        for task in list(self._tasks.values()):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._admin_runner is not None:
            await self._admin_runner.cleanup()
            self._admin_runner = None
        self.client.close()
        await self.dlqs.close()
        await self.keys.close()
        # The last spans get what is left of the drain, and at least a second.
        self.tracing.shutdown(max(drain_ends - loop.time(), 1.0))
        log.info("stopped")

    def _refuse_unparsed(self, status: int, text: str) -> web.Response:
        """The proxy server's own refusal of a head it could not take (malformed, too large,
        too slow), with its access log line."""
        self.request_log.refused(None, None, status)
        return client_error(status, text)

    def task_names(self) -> list[str]:
        return sorted(self._tasks)

    def process_stats(self) -> dict[str, Any]:
        """For GET /stats and the soak benchmark: what a leak would make grow."""
        rss = 0
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        try:
            fds = len(os.listdir("/proc/self/fd"))
        except OSError:
            fds = -1
        return {
            "rss_bytes": rss,
            "open_fds": fds,
            "asyncio_tasks": len(asyncio.all_tasks()),
            "client_connections": (
                len(self._proxy_server.connections) if self._proxy_server is not None else None
            ),
            "background_tasks": self.task_names(),
            "pool": {
                k: {"total": v.total, "idle": v.idle, "waiting": v.waiting}
                for k, v in self.client.stats().items()
            },
            "dlq_writer_queue": depth() if (depth := self.dlqs.queue_depth) is not None else None,
        }

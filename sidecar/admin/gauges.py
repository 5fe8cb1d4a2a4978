"""The Prometheus gauges that describe state, read from their owners at scrape time: the
per-route figures (``engine/figures.py``: breaker, throttle, concurrency limit, per-try
timeout, endpoints), the kill switches, the links to the fleet's Redis, the open tunnels and
the DLQ's counts. A gauge only
projects; it computes no figure of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sidecar.admin.killswitch import KillSwitch
from sidecar.config.store import ConfigStore
from sidecar.core import Clock
from sidecar.engine.figures import BREAKER_GAUGE, RouteFigures, RouteFigureSource
from sidecar.fleet.links import FleetLinks
from sidecar.proxy.tunnel import Tunnels
from sidecar.telemetry.metrics import Labels, Metrics

if TYPE_CHECKING:
    from sidecar.dlq.contract import DlqStorage

DLQ_STATUSES = ("pending", "delivered", "parked")


def wire_gauges(
    metrics: Metrics,
    *,
    figures: RouteFigureSource,
    store: ConfigStore,
    kill: KillSwitch,
    clock: Clock,
    dlq: Callable[[], DlqStorage | None],
    tunnels: Tunnels,
    fleet: FleetLinks,
) -> None:
    def per_route(
        value: Callable[[RouteFigures], float],
    ) -> Callable[[], dict[Labels, float]]:
        def collect() -> dict[Labels, float]:
            return {(("route", f.name),): value(f) for f in figures.at(clock.monotonic())}

        return collect

    def endpoints() -> dict[Labels, float]:
        out: dict[Labels, float] = {}
        for f in figures.at(clock.monotonic()):
            out[(("route", f.name), ("state", "healthy"))] = float(f.endpoints_healthy)
            out[(("route", f.name), ("state", "ejected"))] = float(f.endpoints_ejected)
        return out

    def kill_switches() -> dict[Labels, float]:
        active = {s.scope for s in kill.active(clock.monotonic())}
        out: dict[Labels, float] = {(("scope", "global"),): 0.0}
        for r in store.current.routes:
            out[(("scope", f"route:{r.name}"),)] = 0.0
        for scope in active:
            out[(("scope", scope),)] = 1.0
        return out

    def fleet_connected() -> dict[Labels, float]:
        """One series per use of the fleet's Redis that is on (its link made)."""
        return {(("use", s.use),): 1.0 if s.connected else 0.0 for s in fleet.states()}

    # The DLQ gauges read what the store's writer thread last published: a scrape never
    # runs a query on the event loop.
    def dlq_records() -> dict[Labels, float]:
        opened = dlq()
        if opened is None:
            return {}
        counts = opened.counts.by_status
        return {(("status", st),): float(counts.get(st, 0)) for st in DLQ_STATUSES}

    def dlq_oldest() -> dict[Labels, float]:
        opened = dlq()
        if opened is None:
            return {}
        oldest = opened.counts.oldest_pending
        return {(): max(0.0, clock.wall() - oldest) if oldest is not None else 0.0}

    def dlq_available() -> dict[Labels, float]:
        opened = dlq()
        if opened is not None:
            return {(): 1.0 if opened.available else 0.0}
        if any(r.dlq.enabled for r in store.current.routes):
            return {(): 0.0}  # wanted, but its file could not be opened (yet)
        return {}

    def route_certs() -> dict[Labels, float]:
        """Seconds left of each route's client certificate (the listener's series are the
        listener's own: kept as they come)."""
        now = clock.wall()
        return {
            (("use", f"route:{f.name}"),): f.client_cert_not_after - now
            for f in figures.at(clock.monotonic())
            if f.client_cert_not_after is not None
        }

    m = metrics
    before = m.tls_cert_expiry.collect
    m.tls_cert_expiry.collect = lambda: {**(before() if before else {}), **route_certs()}
    m.throttle_probability.collect = per_route(lambda f: f.throttle_probability)
    m.concurrency_limit.collect = per_route(lambda f: float(f.concurrency_limit))
    m.concurrency_in_flight.collect = per_route(lambda f: float(f.concurrency_in_flight))
    m.per_try_timeout.collect = per_route(lambda f: f.per_try_timeout)
    m.breaker_open_seconds.collect = per_route(lambda f: f.breaker_open_for)
    m.breaker_state.collect = per_route(lambda f: BREAKER_GAUGE[f.breaker])
    m.endpoints.collect = endpoints
    m.upgrades_in_flight.collect = per_route(lambda f: float(tunnels.open.get(f.name, 0)))
    m.dlq_records.collect = dlq_records
    m.dlq_oldest.collect = dlq_oldest
    m.dlq_available.collect = dlq_available
    m.kill_switch.collect = kill_switches
    m.fleet_connected.collect = fleet_connected
    m.reload_ok.set((), 1.0)
    m.reload_ts.set((), clock.wall())

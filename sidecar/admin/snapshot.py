"""A read-only picture of the running sidecar, for the status page, ``GET /status`` and the
``retry-sidecar status`` verb.

It only reads what already exists (the config snapshot, the route figures, the kill switches,
the metrics registry through the rate sampler, the DLQ through its reader connection) and
changes nothing. The one query that touches the disk (``sidecar.dlq.figures``) runs in a thread,
never on the loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from sidecar.admin.killswitch import KillSwitch, Switch
from sidecar.admin.rates import RateSampler
from sidecar.config.store import ConfigStore
from sidecar.config.watch import Reloader
from sidecar.core import Clock
from sidecar.engine.figures import RouteFigures, RouteFigureSource
from sidecar.fleet.links import FleetLinks
from sidecar.lifecycle import Lifecycle
from sidecar.telemetry.metrics import Metrics

WINDOWS = {"10s": 10.0, "1m": 60.0, "5m": 300.0}
DEFAULT_WINDOW = "1m"
DLQ_CACHE_SECONDS = 1.0


class DlqView(Protocol):
    """The DLQ as the page reads it (``sidecar.dlq.figures.DlqFigures``)."""

    def is_open(self) -> bool: ...

    def location(self) -> str: ...

    def warning(self) -> str | None: ...

    async def per_route(self, wall: float) -> dict[str, dict[str, Any]]: ...


@dataclass
class StatusSources:
    """Everything the snapshot reads; wired once by the app."""

    store: ConfigStore
    reloader: Reloader | None
    kill: KillSwitch
    figures: RouteFigureSource
    metrics: Metrics
    clock: Clock
    life: Lifecycle
    rates: RateSampler
    stats: Callable[[], dict[str, Any]]
    dlq: DlqView
    fleet: FleetLinks  # every use's link to the fleet's Redis
    # What the start-up check of the idempotency keys' Redis found (it may evict them), or None.
    idempotency_warning: Callable[[], str | None] = lambda: None
    # The TLS listener's certificate and client CA (``proxy/certreload.ListenerCerts``), or None.
    tls_listener: Callable[[float], dict[str, Any] | None] = lambda wall: None
    started_mono: float = field(default_factory=time.monotonic)
    started_wall: float = field(default_factory=time.time)
    _dlq_cache: tuple[float, dict[str, dict[str, Any]]] | None = None


@dataclass(frozen=True, slots=True)
class SwitchView:
    scope: str
    source: str  # admin | file | fleet
    reason: str
    set_by: str
    set_at: float  # epoch seconds
    expires_at: float
    expires_in: float  # seconds
    set_on: str | None = None  # a fleet switch: the sidecar it was set through


@dataclass(frozen=True, slots=True)
class RouteStatus:
    name: str
    upstream: str
    requests: int  # finished sequences in the window
    rps: float
    success_ratio: float | None  # fate "success" / all; None without traffic
    retries_per_request: float | None
    fates: dict[str, int]
    figures: RouteFigures  # budget, breaker, bulkhead...: flat in the JSON, after fates
    switches: list[SwitchView]  # the active switches that cover this route
    attempts_limit: int  # retry.attempts of the policy
    dlq_enabled: bool
    dlq_pending: int | None  # None when no DLQ is open
    dlq_parked: int | None
    dlq_oldest_pending_age: float | None
    dlq_oldest_parked_age: float | None
    # Guarded writes since start by result (retry_sidecar_idempotency_total, non-zero ones);
    # None when the route does not enable idempotency.
    idempotency: dict[str, int] | None = None

    def as_json(self) -> dict[str, Any]:
        """Flat: the route's figures among its other fields, each by its own name."""
        out: dict[str, Any] = {}
        for k, v in asdict(self).items():
            if k == "figures":
                out.update((n, x) for n, x in self.figures.as_json().items() if n != "name")
            else:
                out[k] = v
        return out


@dataclass(frozen=True, slots=True)
class FleetUse:
    """One use of the fleet's Redis (``process.fleet``, by use name)."""

    state: str  # "connected" or "unreachable"
    # While unreachable: the text of the error that made it so (Redis's own words: a refused
    # password, no such database, a refused connection, "did not answer in time").
    error: str | None
    # What the use does while the Redis is unreachable, as its owner says it.
    while_unreachable: str


@dataclass(frozen=True, slots=True)
class ProcessStatus:
    name: str
    uptime: float
    started_at: float
    config_version: str
    config_source: str
    loaded_at: float
    last_reload_ok: bool
    last_reload_at: float | None
    last_error: str | None
    restart_required: list[str]
    ready: bool
    draining: bool
    rss_bytes: int
    open_fds: int
    client_connections: int | None
    upstream_connections: int
    upstream_idle: int
    dlq: str  # "open", "off" (no route uses it) or "unavailable"
    dlq_path: str
    # Every use of the fleet's Redis that is on (killswitch, idempotency, dlq), by name; empty
    # without fleet mode.
    fleet: dict[str, FleetUse] = field(default_factory=dict)
    # What the start-up check of the DLQ's store found wrong (a fleet Redis that does not
    # fsync every write, or whose settings cannot be read), or None.
    dlq_warning: str | None = None
    # What the start-up check of the idempotency keys' store found wrong (a fleet Redis that may
    # evict keys, or whose settings cannot be read), or None.
    idempotency_warning: str | None = None
    # The TLS listener's certificate and client CA: subject, issuer, expiry, the time left
    # (``expires_in``, seconds), SHA-256; None for a plaintext listener.
    tls_listener: dict[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Status:
    at: float  # epoch seconds
    window: str
    window_seconds: float  # the span the figures actually cover
    process: ProcessStatus
    routes: list[RouteStatus]
    switches: list[SwitchView]

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["routes"] = [r.as_json() for r in self.routes]
        return out


def switch_view(s: Switch, wall: float) -> SwitchView:
    left = max(0.0, s.expires_at - wall)
    return SwitchView(s.scope, s.source, s.reason, s.set_by, s.set_at, s.expires_at, left, s.set_on)


def _ratio(num: int, den: int) -> float | None:
    return num / den if den else None


def _idempotency(metrics: Metrics, route: str) -> dict[str, int]:
    """A route's ``idempotency_total`` by result, the results that happened."""
    out: dict[str, int] = {}
    for labels, value in metrics.idempotency.values.items():
        by = dict(labels)
        if by.get("route") == route and value:
            out[by["result"]] = int(value)
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


async def take(src: StatusSources, window: str = DEFAULT_WINDOW) -> Status:
    now, wall = src.clock.monotonic(), src.clock.wall()
    config = src.store.current
    win = src.rates.window(WINDOWS.get(window, WINDOWS[DEFAULT_WINDOW]))
    switches = [switch_view(s, wall) for s in src.kill.active(now)]
    dlq_open = src.dlq.is_open()
    per_route_dlq = await dlq_figures(src)
    routes = []
    figures = {f.name: f for f in src.figures.at(now)}
    for r in config.routes:
        w = win.routes.get(r.name)
        requests = w.requests if w else 0
        fates = dict(sorted(w.fates.items(), key=lambda kv: -kv[1])) if w else {}
        d = per_route_dlq.get(r.name, {})
        routes.append(
            RouteStatus(
                name=r.name,
                upstream=str(r.upstream),
                requests=requests,
                rps=requests / win.seconds if win.seconds > 0 else 0.0,
                success_ratio=_ratio(fates.get("success", 0), requests),
                retries_per_request=_ratio(w.retries, requests) if w else None,
                fates=fates,
                figures=figures[r.name],
                switches=[s for s in switches if s.scope in ("global", f"route:{r.name}")],
                attempts_limit=r.retry.attempts,
                dlq_enabled=r.dlq.enabled,
                dlq_pending=d.get("pending", 0) if dlq_open else None,
                dlq_parked=d.get("parked", 0) if dlq_open else None,
                dlq_oldest_pending_age=d.get("pending_age"),
                dlq_oldest_parked_age=d.get("parked_age"),
                idempotency=_idempotency(src.metrics, r.name) if r.idempotency.enabled else None,
            )
        )
    stats = src.stats()
    pools = stats.get("pool", {}).values()
    reload_ok = src.metrics.reload_ok.values.get((), 1.0) == 1.0
    reload_at = src.metrics.reload_ts.values.get(())
    process = ProcessStatus(
        name=config.name,
        uptime=now - src.started_mono,
        started_at=src.started_wall,
        config_version=config.sha256,
        config_source=config.source,
        loaded_at=src.store.loaded.loaded_at,
        last_reload_ok=reload_ok,
        last_reload_at=reload_at,
        last_error=src.store.last_error,
        restart_required=list(src.reloader.restart_required) if src.reloader else [],
        ready=src.life.ready,
        draining=src.life.draining,
        rss_bytes=int(stats.get("rss_bytes", 0)),
        open_fds=int(stats.get("open_fds", -1)),
        client_connections=stats.get("client_connections"),
        upstream_connections=sum(int(p.get("total", 0)) for p in pools),
        upstream_idle=sum(int(p.get("idle", 0)) for p in pools),
        dlq="open" if dlq_open else _dlq_off(src),
        dlq_path=src.dlq.location(),
        fleet={s.use: FleetUse(s.state, s.error, s.while_unreachable) for s in src.fleet.states()},
        dlq_warning=src.dlq.warning(),
        idempotency_warning=src.idempotency_warning(),
        tls_listener=src.tls_listener(wall),
    )
    return Status(wall, window, win.seconds, process, routes, switches)


def _dlq_off(src: StatusSources) -> str:
    wanted = any(r.dlq.enabled for r in src.store.current.routes)
    return "unavailable" if wanted else "off"


async def dlq_figures(src: StatusSources) -> dict[str, dict[str, Any]]:
    """Per route: ``pending``/``parked`` counts and ``pending_age``/``parked_age`` (seconds).
    Cached for a second, so many open pages cost one read."""
    now = src.clock.monotonic()
    if src._dlq_cache is not None and now - src._dlq_cache[0] < DLQ_CACHE_SECONDS:
        return src._dlq_cache[1]
    out = await src.dlq.per_route(src.clock.wall())
    src._dlq_cache = (now, out)
    return out

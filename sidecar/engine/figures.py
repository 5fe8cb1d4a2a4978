"""The per-route figures, computed once, here, from the route's state (``routestate``) and its
policy: budget left, the per-try timeout in force, endpoint health, the breaker and its timers,
the throttle, the concurrency limit and the bulkhead.

Every view projects one ``RouteFigures``: ``GET /status`` and the status page
(``admin/snapshot.py``, ``admin/render.py``), the ``retry-sidecar status`` table
(``admin/verbs.py``), ``GET /breakers`` (``admin/server.py``) and the Prometheus gauges
(``admin/gauges.py``). None of them reads a route's state itself (``tests/engine/test_figures.py``).

A figure is declared once, below, with how it is computed (``figures_of``). It is in
``GET /status`` by its field name; one whose field carries ``column`` metadata is also a column
of the status page and of the CLI's table, under that title (``COLUMNS``): declared as
``x: int = field(metadata=column("X"))``, at the end.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields

from sidecar.config.model import Config, Route
from sidecar.config.tls import CertInfo, cert_info, utc_text
from sidecar.engine.routestate import RouteState, RouteStates
from sidecar.retry.breaker import GAUGE, State
from sidecar.retry.budget import Budget

# The breaker's state as the breaker_state gauge says it (0 closed, 1 half-open, 2 open).
BREAKER_GAUGE = {s.value: float(n) for s, n in GAUGE.items()}


def column(title: str) -> dict[str, str]:
    """The metadata of a figure shown as a column of its own on the page and in the CLI."""
    return {"column": title}


@dataclass(frozen=True, slots=True)
class RouteFigures:
    name: str
    breaker: str  # closed | open | half-open
    next_probe_in: float | None  # while open: seconds until a probe is let through
    breaker_open_for: float  # the current (or next) open period: it doubles on reopens
    breaker_opened_at_wall: float | None  # epoch seconds, while open or half-open
    breaker_sequences: int
    breaker_failures: int
    budget_left: int  # retries the budget allows right now
    budget_requests: int  # requests counted in the budget's own window
    budget_retries: int  # retries counted in the budget's own window
    budget_window: float
    per_try_timeout: float  # seconds: the policy's, or the adaptive one in force
    endpoints_healthy: int
    endpoints_ejected: int
    throttle_probability: float  # that a retry or hedge is refused now (0 when off)
    concurrency_limit: int  # the adaptive limit, or max_concurrent when not adaptive
    concurrency_in_flight: int  # attempts holding a ticket of the concurrency limit
    in_flight: int  # sequences holding a bulkhead slot
    max_concurrent: int  # bulkhead slots
    # https:// upstreams: None for a route without one; False: verify: false (a warning)
    tls_verify: bool | None = None
    client_cert_subject: str | None = None  # the client certificate presented (mutual TLS)
    client_cert_not_after: float | None = None  # its expiry, epoch seconds
    # The three above in words, a column of the page and the CLI's table.
    tls: str | None = field(default=None, metadata=column("TLS"))

    def as_json(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# (field name, title) of the figures shown as columns of their own, in declaration order.
COLUMNS: list[tuple[str, str]] = [
    (f.name, f.metadata["column"]) for f in fields(RouteFigures) if "column" in f.metadata
]


def allowed(budget: Budget, now: float) -> tuple[int, int, int]:
    """(extra attempts still allowed now, requests counted, extra attempts counted) by the rule
    the budget itself applies."""
    p = budget.policy
    requests, retries = budget.counts(now)
    allowed = p.ratio * requests + p.min_per_second * p.window
    return max(0, math.ceil(allowed - retries)), requests, retries


def per_try_timeout(st: RouteState, route: Route, now: float) -> float:
    p = route.retry.per_try_timeout
    if p is not None:
        return p
    a = route.retry.auto_timeout
    return st.latency.timeout(now, a.percentile, a.multiplier, a.min, a.max)


_CERTS: dict[str, tuple[tuple[int, int], CertInfo | None]] = {}


def client_cert(path: str | None) -> CertInfo | None:
    """What the client certificate file says, read again only when the file changed."""
    if path is None:
        return None
    try:
        st = os.stat(path)
    except OSError:
        return None
    stamp = (st.st_mtime_ns, st.st_size)
    known = _CERTS.get(path)
    if known is not None and known[0] == stamp:
        return known[1]
    try:
        info: CertInfo | None = cert_info(path)
    except ValueError:
        info = None
    _CERTS[path] = (stamp, info)
    return info


def figures_of(st: RouteState, route: Route, now: float) -> RouteFigures:
    b = st.breaker
    next_probe = None
    if b.state is State.OPEN and b.opened_at is not None:
        next_probe = max(0.0, b.opened_at + b.open_period - now)  # doubles on reopens
    seqs, fails = b.counts(now)
    left, requests, retries = allowed(st.budget, now)
    healthy = st.endpoints.healthy(now)
    cert = client_cert(route.tls.client_cert) if st.tls_hosts else None
    return RouteFigures(
        name=route.name,
        breaker=b.state.value,
        next_probe_in=next_probe,
        breaker_open_for=b.open_period,
        breaker_opened_at_wall=b.opened_at_wall,
        breaker_sequences=seqs,
        breaker_failures=fails,
        budget_left=left,
        budget_requests=requests,
        budget_retries=retries,
        budget_window=st.budget.policy.window,
        per_try_timeout=per_try_timeout(st, route, now),
        endpoints_healthy=healthy,
        endpoints_ejected=len(st.endpoints.endpoints) - healthy,
        throttle_probability=st.throttle.probability(now) if route.throttle.enabled else 0.0,
        concurrency_limit=(
            int(st.limiter.limit) if route.bulkhead.adaptive else route.bulkhead.max_concurrent
        ),
        concurrency_in_flight=st.limiter.in_flight,
        in_flight=st.bulkhead.in_flight,
        max_concurrent=st.bulkhead.policy.max_concurrent,
        tls_verify=route.tls.verify if st.tls_hosts else None,
        client_cert_subject=cert.subject if cert is not None else None,
        client_cert_not_after=cert.not_after if cert is not None else None,
        tls=tls_text(route, cert) if st.tls_hosts else None,
    )


def tls_text(route: Route, cert: CertInfo | None) -> str:
    said = "verified" if route.tls.verify else "NOT VERIFIED (verify: false)"
    if cert is not None:
        said += f"; client cert {cert.subject}, expires {utc_text(cert.not_after)}"
    return said


class RouteFigureSource:
    """The figures of every route of the current config, at one instant: what the views read."""

    def __init__(self, states: RouteStates, config: Callable[[], Config]) -> None:
        self._states = states
        self._config = config

    def at(self, now: float) -> list[RouteFigures]:
        """In the config's route order."""
        return [figures_of(self._states.get(r.name), r, now) for r in self._config().routes]

"""Prometheus metrics (text format 0.0.4), fed by the core's events.

A small registry of our own instead of prometheus_client's metric objects: label values here are
all bounded (route names from the config, fixed fate/outcome words), updates are dict increments
on the hot path (prometheus_client's take a lock and a label lookup per update), and rendering
happens only when /metrics is scraped. What prometheus_client does well is used where it is:
its process collector and its OpenMetrics exposition (``exposition.py``, at scrape only).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Iterable

from sidecar import __version__, build
from sidecar.core import Fate
from sidecar.telemetry.events import (
    AttemptEnded,
    BreakerTransitioned,
    HedgeEvent,
    RetrySent,
    SequenceEnded,
)

PREFIX = "retry_sidecar_"

# Label values known in advance, exported at 0 for every route from the first scrape
# (Prometheus' "avoid missing metrics"): a series that first appears at 1 is invisible to
# increase() and rate(), which need a sample before it. Fates: every Fate, and body-broken.
KNOWN_FATES = (*[f.value for f in Fate], "body-broken")
BREAKER_STATES = ("closed", "half-open", "open")
DLQ_RESULTS = ("stored", "full", "unavailable", "body-too-large")
ADMIN_AUTH_VIAS = ("api", "status-page")
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

Labels = tuple[tuple[str, str], ...]


def _fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    if v == math.inf:
        return "+Inf"
    if float(v).is_integer():
        return str(int(v))
    return repr(float(v))


class Counter:
    def __init__(self, name: str, help_: str) -> None:
        self.name = PREFIX + name
        self.help = help_
        self.values: dict[Labels, float] = {}

    def inc(self, labels: Labels, by: float = 1.0) -> None:
        self.values[labels] = self.values.get(labels, 0.0) + by

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} counter"
        for labels, v in sorted(self.values.items()):
            yield f"{self.name}{_fmt_labels(labels)} {_num(v)}"


class Gauge:
    def __init__(self, name: str, help_: str) -> None:
        self.name = PREFIX + name
        self.help = help_
        self.values: dict[Labels, float] = {}
        self.collect: Callable[[], dict[Labels, float]] | None = None  # computed at scrape

    def set(self, labels: Labels, v: float) -> None:
        self.values[labels] = v

    def current(self) -> dict[Labels, float]:
        """The values set and those computed now."""
        values = dict(self.values)
        if self.collect is not None:
            values.update(self.collect())
        return values

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} gauge"
        for labels, v in sorted(self.current().items()):
            yield f"{self.name}{_fmt_labels(labels)} {_num(v)}"


class Histogram:
    def __init__(self, name: str, help_: str, buckets: tuple[float, ...] = DURATION_BUCKETS):
        self.name = PREFIX + name
        self.help = help_
        self.buckets = buckets
        self.series: dict[Labels, list[float]] = {}  # bucket counts..., +Inf count, sum
        # The last traced observation of each bucket, (trace id, value), shown as the bucket's
        # exemplar in OpenMetrics: from a slow bucket to one of its traces.
        self.exemplars: dict[Labels, dict[int, tuple[str, float]]] = {}

    def observe(self, labels: Labels, v: float) -> None:
        s = self.series.get(labels)
        if s is None:
            s = self.series[labels] = [0.0] * (len(self.buckets) + 2)
        s[bisect_left(self.buckets, v)] += 1  # the first bucket >= v; past the last: +Inf
        s[-1] += v

    def exemplar(self, labels: Labels, v: float, trace_id: str) -> None:
        """Keep ``trace_id`` as the exemplar of the bucket ``v`` (observed) falls in."""
        ex = self.exemplars.get(labels)
        if ex is None:
            ex = self.exemplars[labels] = {}
        ex[bisect_left(self.buckets, v)] = (trace_id, v)

    def render(self) -> Iterable[str]:
        yield f"# HELP {self.name} {self.help}"
        yield f"# TYPE {self.name} histogram"
        for labels, s in sorted(self.series.items()):
            cum = 0.0
            for i, b in enumerate(self.buckets):
                cum += s[i]
                yield f"{self.name}_bucket{_fmt_labels((*labels, ('le', _num(b))))} {_num(cum)}"
            cum += s[len(self.buckets)]
            yield f"{self.name}_bucket{_fmt_labels((*labels, ('le', '+Inf')))} {_num(cum)}"
            yield f"{self.name}_sum{_fmt_labels(labels)} {_num(s[-1])}"
            yield f"{self.name}_count{_fmt_labels(labels)} {_num(cum)}"


class Metrics:
    """The metrics listed in docs/observability.md ("Metrics"), and an EventSink that keeps
    them current.

    Their names are a contract: the chart's dashboard and alerts use them, and
    tests/telemetry/test_monitoring.py fails when one is renamed.
    """

    def __init__(self) -> None:
        self.requests = Counter("requests_total", "Client requests by route and fate.")
        self.attempts = Counter("attempts_total", "Upstream attempts by route and outcome.")
        self.retries = Counter("retries_total", "Retries sent by route.")
        self.budget_exhausted = Counter(
            "retry_budget_exhausted_total", "Retries denied by the retry budget."
        )
        self.breaker_state = Gauge("breaker_state", "0 closed, 1 half-open, 2 open.")
        self.breaker_transitions = Counter(
            "breaker_transitions_total", "Breaker transitions by route and new state."
        )
        self.kill_switch = Gauge("kill_switch_active", "1 while a kill switch is set.")
        self.fleet_connected = Gauge(
            "fleet_connected",
            "1 while the fleet's Redis answers the calls of a use of it (label use), 0 while "
            "it is unreachable; a series per use that is on.",
        )
        self.request_duration = Histogram(
            "request_duration_seconds", "Whole retry sequence duration, by route."
        )
        self.attempt_duration = Histogram(
            "upstream_attempt_duration_seconds", "One upstream attempt, to its response head."
        )
        self.reload_ok = Gauge(
            "config_last_reload_successful", "1 if the last config reload succeeded."
        )
        self.reload_ts = Gauge(
            "config_last_reload_timestamp_seconds", "When the config was last (re)loaded."
        )
        self.malformed = Counter(
            "malformed_requests_total", "Requests refused before routing, by reason."
        )
        self.dlq_records = Gauge("dlq_records", "DLQ records by status.")
        self.dlq_oldest = Gauge(
            "dlq_oldest_record_age_seconds", "Age of the oldest pending DLQ record."
        )
        self.dlq_available = Gauge(
            "dlq_available",
            "1 while the DLQ takes records; 0 while a DLQ route has no usable file (it could "
            "not be opened, and opening is being tried again).",
        )
        self.dlq_file_recreated = Counter(
            "dlq_file_recreated_total",
            "Times the DLQ found its storage lost under it: its file deleted (SQLite; what it "
            "held was written to a new file at its path), or the fleet Redis's DLQ data gone "
            "(dlq.backend redis: its epoch changed; records acknowledged before may be lost).",
        )
        self.hedges = Counter(
            "hedges_total",
            "Hedged attempts by route and result (sent, won, denied-limit, denied-budget, "
            "denied-throttle).",
        )
        # Storm control state, read from the route states at scrape (Sidecar._wire_gauges).
        self.throttle_probability = Gauge(
            "throttle_probability",
            "Probability that the adaptive throttle refuses a retry or hedge now.",
        )
        self.concurrency_limit = Gauge(
            "concurrency_limit", "The adaptive concurrency limit (upstream attempts in flight)."
        )
        self.concurrency_in_flight = Gauge("concurrency_in_flight", "Upstream attempts in flight.")
        self.per_try_timeout = Gauge(
            "per_try_timeout_seconds",
            "The per-try timeout now in force (the adaptive one for per_try_timeout: auto).",
        )
        self.breaker_open_seconds = Gauge(
            "breaker_open_seconds",
            "How long the breaker stays open when it opens next (or now): open_for, doubled "
            "on each reopen up to max_open_for.",
        )
        self.endpoints = Gauge("endpoints", "Upstream endpoints by route and state.")
        self.dlq_writes = Counter(
            "dlq_writes_total",
            "Failed writes offered to the DLQ, by route and result "
            "(stored, full, unavailable, body-too-large).",
        )
        self.admin_auth_failures = Counter(
            "admin_auth_failures_total",
            "Admin requests refused for a missing or wrong token, by way in (api, status-page).",
        )
        for via in ADMIN_AUTH_VIAS:
            self.admin_auth_failures.values[(("via", via),)] = 0.0
        self.upgrades = Counter(
            "upgrades_total",
            "Upgrade (WebSocket) requests by route and result: how a tunnel ended (closed, "
            "idle-timeout, reset, cut) or why none opened (refused, failed).",
        )
        self.upgrades_in_flight = Gauge("upgrades_in_flight", "Open upgrade tunnels by route.")
        self.idempotency = Counter(
            "idempotency_total",
            "Guarded writes (routes with idempotency enabled) by route and result: first, "
            "replayed, in-progress, mismatch, invalid, missing, released, lease-expired, "
            "store-error.",
        )
        self.tls_handshakes = Counter(
            "tls_handshakes_total",
            "TLS handshakes by side (listener: clients of the TLS listener; upstream: the "
            "sidecar to https:// upstreams) and result (ok, tls-certificate, tls-handshake, "
            "connect-failure).",
        )
        self.tls_cert_expiry = Gauge(
            "tls_cert_expiry_seconds",
            "Seconds until a certificate the sidecar presents expires, by use (listener; "
            "route:<name> for a route's client certificate); negative once expired.",
        )
        self.tls_reloads = Counter(
            "tls_reloads_total",
            "Changes of the listener's certificate files by result: ok (in force for the next "
            "handshake), missing, invalid (does not parse: half written; an encrypted key), "
            "mismatch (a key of another certificate), expired (outside its validity period); "
            "refused ones leave the pair in force serving.",
        )
        self.grpc_calls = Counter(
            "grpc_calls_total",
            "gRPC calls (content-type application/grpc) by route and the final gRPC status "
            "the client got (OK, UNAVAILABLE, DEADLINE_EXCEEDED...).",
        )
        self.build_info = Gauge(
            "build_info", "1, labelled with the version and the build (compiled or pure)."
        )
        self.build_info.set((("version", __version__), ("build", build())), 1.0)
        # Label tuples of the per-request series, made once per route and value: the event
        # handlers below then do plain dict increments.
        self._route: dict[str, Labels] = {}
        self._fate: dict[str, dict[str, Labels]] = {}
        self._outcome: dict[str, dict[str, Labels]] = {}

    def all(self) -> list[Counter | Gauge | Histogram]:
        return [
            self.requests,
            self.attempts,
            self.retries,
            self.budget_exhausted,
            self.breaker_state,
            self.breaker_transitions,
            self.kill_switch,
            self.fleet_connected,
            self.request_duration,
            self.attempt_duration,
            self.reload_ok,
            self.reload_ts,
            self.malformed,
            self.dlq_records,
            self.dlq_oldest,
            self.dlq_writes,
            self.dlq_available,
            self.dlq_file_recreated,
            self.hedges,
            self.throttle_probability,
            self.concurrency_limit,
            self.concurrency_in_flight,
            self.per_try_timeout,
            self.breaker_open_seconds,
            self.endpoints,
            self.admin_auth_failures,
            self.upgrades,
            self.upgrades_in_flight,
            self.idempotency,
            self.tls_handshakes,
            self.tls_cert_expiry,
            self.tls_reloads,
            self.grpc_calls,
            self.build_info,
        ]

    def render(self) -> str:
        lines: list[str] = []
        for m in self.all():
            lines.extend(m.render())
        return "\n".join(lines) + "\n"

    def declare_routes(self, routes: Iterable[tuple[str, bool]]) -> None:
        """Start the per-route counters of each (route name, DLQ enabled) at 0 where they
        have no value yet; called at start and on every reload. A removed route's series
        stay, as counters do."""
        for route, dlq in routes:
            labels = self._route_labels(route)
            for counter in (self.retries, self.budget_exhausted):
                counter.values.setdefault(labels, 0.0)
            for fate in KNOWN_FATES:
                self.requests.values.setdefault(self._pair(self._fate, route, "fate", fate), 0.0)
            for to in BREAKER_STATES:
                self.breaker_transitions.values.setdefault((("route", route), ("to", to)), 0.0)
            if dlq:
                for result in DLQ_RESULTS:
                    self.dlq_writes.values.setdefault((("route", route), ("result", result)), 0.0)

    def declare_idempotency(self, routes: Iterable[str], results: Iterable[str]) -> None:
        """Start ``idempotency_total`` of each route that enables it at 0 for every result
        (the labels are the idempotency package's, passed in); called with declare_routes."""
        labels = list(results)
        for route in routes:
            for result in labels:
                self.idempotency.values.setdefault((("route", route), ("result", result)), 0.0)

    # -- EventSink ---------------------------------------------------------------------------

    def _route_labels(self, route: str) -> Labels:
        labels = self._route.get(route)
        if labels is None:
            labels = self._route[route] = (("route", route),)
        return labels

    @staticmethod
    def _pair(table: dict[str, dict[str, Labels]], route: str, name: str, value: str) -> Labels:
        inner = table.get(route)
        if inner is None:
            inner = table[route] = {}
        labels = inner.get(value)
        if labels is None:
            labels = inner[value] = (("route", route), (name, value))
        return labels

    def attempt_ended(self, e: AttemptEnded) -> None:
        self.attempts.inc(self._pair(self._outcome, e.route, "outcome", e.outcome))
        self.attempt_duration.observe(self._route_labels(e.route), e.duration)

    def retry_sent(self, e: RetrySent) -> None:
        self.retries.inc(self._route_labels(e.route))

    def sequence_ended(self, e: SequenceEnded) -> None:
        self.requests.inc(self._pair(self._fate, e.route, "fate", e.fate))
        self.request_duration.observe(self._route_labels(e.route), e.duration)
        if e.trace_id is not None:
            self.request_duration.exemplar(self._route_labels(e.route), e.duration, e.trace_id)
        if e.fate == "budget-exhausted":
            self.budget_exhausted.inc(self._route_labels(e.route))
        if e.grpc is not None:
            self.grpc_calls.inc((("route", e.route), ("code", e.grpc)))

    def hedged(self, e: HedgeEvent) -> None:
        self.hedges.inc((("route", e.route), ("result", e.result)))

    def breaker_transitioned(self, e: BreakerTransitioned) -> None:
        self.breaker_transitions.inc((("route", e.route), ("to", e.to)))
        # breaker_state is read from the breakers at scrape time (Sidecar._wire_gauges).

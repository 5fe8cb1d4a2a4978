"""The validated configuration: frozen dataclasses, built once per load by ``parse``.

A request reads one ``Config`` snapshot and keeps it for all of its attempts; a reload builds a
whole new ``Config`` and swaps one reference (see ``store``).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from typing import Literal, Protocol

from sidecar.config.units import MAX_SIZE
from sidecar.outcomes import DEFAULT_RETRY_KINDS, DEFAULT_RETRY_STATUSES, OutcomeKind

BackoffStrategy = Literal[
    "full_jitter", "equal_jitter", "decorrelated_jitter", "exponential", "constant"
]
NonIdempotent = Literal["never", "with-idempotency-key", "always"]
DlqRespond = Literal["passthrough", "accepted"]

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True, slots=True)
class Backoff:
    strategy: BackoffStrategy = "full_jitter"
    base: float = 0.025
    max: float = 0.25


@dataclass(frozen=True, slots=True)
class RetryOn:
    """The outcomes that may be retried: failure kinds (the ``retry_on`` words of
    ``sidecar.outcomes``) and upstream statuses."""

    kinds: frozenset[OutcomeKind] = DEFAULT_RETRY_KINDS
    statuses: frozenset[int] = DEFAULT_RETRY_STATUSES


@dataclass(frozen=True, slots=True)
class RetryAfter:
    honor: bool = True
    max: float = 30.0


@dataclass(frozen=True, slots=True)
class AutoTimeout:
    """``retry.per_try_timeout: auto``: ``multiplier`` x the ``percentile`` of the route's
    recent attempt latencies, clamped to [min, max]. When it expires, an attempt that may be
    hedged is raced by a new one (never abandoned); any other attempt waits for the deadline."""

    percentile: float = 0.95
    multiplier: float = 2.0
    min: float = 0.05
    max: float = 10.0


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = 3
    # None is ``auto`` (see AutoTimeout); a number is a fixed per-try timeout: the attempt is
    # abandoned when it expires and counts as a per-try-timeout failure.
    per_try_timeout: float | None = None
    auto_timeout: AutoTimeout = field(default_factory=AutoTimeout)
    backoff: Backoff = field(default_factory=Backoff)
    retry_on: RetryOn = field(default_factory=RetryOn)
    retry_after: RetryAfter = field(default_factory=RetryAfter)
    non_idempotent: NonIdempotent = "with-idempotency-key"
    max_body_bytes: int = 64 * 1024


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    enabled: bool = True
    # "Down", not "degraded": a 60% partial failure is the throttle's business, and a breaker
    # that opens on it turns a 60% failure into a 100% one.
    failure_ratio: float = 0.95
    min_sequences: int = 20
    window: float = 10.0
    open_for: float = 1.0  # the first time it opens; doubled on each reopen up to max_open_for
    max_open_for: float = 30.0
    half_open_probes: int = 3  # ramp sequences judged before the half-open state may decide
    ramp: float = 1.0  # half-open admits a share of traffic growing from 0 to all over this


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    ratio: float = 0.5
    min_per_second: float = 10.0
    window: float = 10.0


@dataclass(frozen=True, slots=True)
class BulkheadPolicy:
    max_concurrent: int = 1000
    queue_timeout: float = 1.0
    # The adaptive concurrency limit: upstream attempts in flight follow latency between
    # min_concurrent and max_concurrent (a gradient limit, as Envoy's adaptive-concurrency).
    # Opt-in, as Envoy's filter is: it reads long-polls and slow handlers as overload and
    # refuses requests that the app, asked directly, would answer.
    adaptive: bool = False
    min_concurrent: int = 5


@dataclass(frozen=True, slots=True)
class ThrottlePolicy:
    """Adaptive throttling (Google SRE book, "Handling Overload") of the attempts the sidecar
    adds (retries and hedges): refused with probability
    max(0, (requests - k * accepts) / (requests + 1)) over ``window``."""

    enabled: bool = True
    k: float = 2.0
    window: float = 1.0  # short: an outage is seen within half a second, not a minute
    min_requests: int = 10


# RFC 9110 section 9.2.2 (what may be retried after its bytes may have reached the upstream).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# What a route that turns hedging on hedges unless it lists more (``hedge.methods``): the safe
# methods, whose duplicate cannot change what the winner answers.
HEDGE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """Hedged requests, opt-in per route (as Envoy's and gRPC's): an attempt of one of
    ``methods`` still running when the per-try timeout expires is raced by another one
    (preferably to another endpoint); the first answer wins and the others are cancelled.
    Never a request with an Idempotency-Key: a second copy in flight while the first runs is
    what such a server refuses (409). RFC 9110's idempotency promises the same effect of a
    repeated request, not the same response: a hedged DELETE or ``If-Match`` PUT whose copy
    wins answers 404 or 412 for a write that was applied, so writes are hedged only when the
    route lists them. Hedges draw from their own budget: at most ``ratio`` of the requests in
    ``window`` plus ``min_per_second``."""

    enabled: bool = False
    methods: frozenset[str] = HEDGE_METHODS
    ratio: float = 0.1
    min_per_second: float = 1.0
    window: float = 10.0


@dataclass(frozen=True, slots=True)
class UpgradePolicy:
    """HTTP Upgrade (WebSocket and others): passed through as a tunnel when enabled (the
    upstream's 101 relayed, then bytes both ways), cut after ``idle_timeout`` without a byte
    either way. Disabled, an upgrade request is an ordinary request without its ``Upgrade``,
    as nginx sends it without upgrade configuration."""

    enabled: bool = True
    idle_timeout: float = 3600.0  # Envoy's TCP proxy idle timeout


@dataclass(frozen=True, slots=True)
class RedrivePolicy:
    enabled: bool = False
    interval: float = 30.0


@dataclass(frozen=True, slots=True)
class RouteDlq:
    enabled: bool = False
    respond: DlqRespond = "passthrough"
    keep_credentials: bool = False
    max_replays: int = 5
    replay_rate: float = 50.0
    redrive: RedrivePolicy = field(default_factory=RedrivePolicy)
    # Lower-case header names never stored with a record (beyond the credentials, which
    # keep_credentials governs).
    drop_headers: frozenset[str] = frozenset()


class PathPattern(Protocol):
    """A compiled ``path_regex`` (RE2's, see config/parse.py): its source and a full match."""

    @property
    def pattern(self) -> str: ...

    def fullmatch(self, text: str) -> object | None: ...


@dataclass(frozen=True, slots=True)
class Match:
    path: str | None = None
    path_prefix: str | None = None
    path_regex: PathPattern | None = None
    methods: frozenset[str] | None = None
    # (lower-case header name, exact value) pairs; all must be present.
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class Upstream:
    host: str
    port: int

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"http://{self.authority}"


@dataclass(frozen=True, slots=True)
class Route:
    name: str
    match: Match
    upstreams: tuple[Upstream, ...]  # one or more endpoints (a DNS name may add more)
    timeout: float
    retry: RetryPolicy
    breaker: BreakerPolicy
    budget: BudgetPolicy
    bulkhead: BulkheadPolicy
    dlq: RouteDlq
    # The longest silence between two reads of a response body being relayed (after the head,
    # which per_try_timeout bounds); nginx's proxy_read_timeout, 60 s.
    stream_idle_timeout: float = 60.0
    throttle: ThrottlePolicy = field(default_factory=ThrottlePolicy)
    hedge: HedgePolicy = field(default_factory=HedgePolicy)
    upgrade: UpgradePolicy = field(default_factory=UpgradePolicy)

    @property
    def upstream(self) -> Upstream:
        """The first endpoint: its authority is the Host of an HTTP/1.0 request without one."""
        return self.upstreams[0]


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Admin:
    listen: Listen = field(default_factory=lambda: Listen("127.0.0.1", 15000))
    token_env: str | None = "RETRY_SIDECAR_ADMIN_TOKEN"
    # Host names (lower case, no port) the admin listener answers besides the loopback names,
    # its listen address and the address a connection arrived at (sidecar.admin.origin).
    allowed_hosts: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class DlqFile:
    path: str = "./data/dlq.sqlite3"
    max_records: int = 100_000
    max_bytes: int = 1024**3


# ``unlimited`` where a size may be: the largest size a config can hold.
UNLIMITED_SIZE = MAX_SIZE


@dataclass(frozen=True, slots=True)
class Limits:
    max_header_bytes: int = 32 * 1024
    header_timeout: float = 10.0
    body_idle_timeout: float = 30.0
    # A client connection idle between requests is closed after this (nginx's default is 75 s;
    # aiohttp's own is an hour). Each idle connection costs ~10 KB here.
    keepalive_timeout: float = 75.0
    # No limit by default (``unlimited``), as Envoy and Linkerd: bodies over the route's
    # retry.max_body_bytes are streamed, never held, so memory is bounded by what is buffered.
    # A 20 MiB git push or a 30 MiB package upload must pass as it does direct.
    max_request_body: int = UNLIMITED_SIZE
    # A client that takes no response bytes for this long is cut, and everything its request
    # held (bulkhead slot, upstream connection, buffers) is given back (nginx's send_timeout).
    send_timeout: float = 60.0


@dataclass(frozen=True, slots=True)
class UpstreamPool:
    """The pooled keep-alive connections to each upstream (host, port)."""

    max_connections: int = 1024
    wait_timeout: float = 1.0  # waiting for a free connection, separate from connecting
    connect_timeout: float = 1.0
    # Closed after this long unused. Keep it below the upstream's own keep-alive timeout
    # (Node.js 5 s, gunicorn 2 s, nginx 75 s), so the upstream never closes a connection
    # just as the sidecar reuses it.
    idle_timeout: float = 4.0
    # Upstream host names are resolved to all their addresses (each one an endpoint) and
    # re-resolved this often.
    dns_refresh: float = 5.0


@dataclass(frozen=True, slots=True)
class FileKillSwitch:
    """One entry of the ``killswitches:`` section: retries off for ``scope`` until ``until``."""

    scope: str  # "global" or "route:<name>"
    reason: str
    until: float  # epoch seconds
    line: int  # where the entry is written, for warnings and set_by
    index: int  # its position in the list: killswitches[index]


@dataclass(frozen=True, slots=True)
class Config:
    version: int
    name: str
    listen: Listen
    admin: Admin
    trusted_peers: tuple[IpNetwork, ...]
    dlq: DlqFile
    limits: Limits
    drain_timeout: float
    routes: tuple[Route, ...]
    upstream_pool: UpstreamPool = field(default_factory=UpstreamPool)
    killswitches: tuple[FileKillSwitch, ...] = ()
    source: str = "<memory>"
    sha256: str = ""

    def route(self, name: str) -> Route | None:
        for r in self.routes:
            if r.name == name:
                return r
        return None

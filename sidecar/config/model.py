"""The validated configuration: frozen dataclasses, built once per load by ``parse``. A request
reads one ``Config`` snapshot and keeps it for all of its attempts; a reload builds a whole new
``Config`` and swaps one reference (see ``store``). Each field declared with ``key`` or
``section`` is a key of the file: its default, check, help and reload rule are written there
once (``schema``); the per-route sections are in ``policies``."""

from __future__ import annotations

import socket
from dataclasses import dataclass

from sidecar.config import checks as c
from sidecar.config.dlqfile import DlqFile
from sidecar.config.errors import ConfigIssue
from sidecar.config.fileswitch import FileKillSwitch
from sidecar.config.fleet import Fleet
from sidecar.config.idempotency import IdempotencyPolicy, IdempotencyStorage
from sidecar.config.limits import UNLIMITED_SIZE, Http2, Limits
from sidecar.config.policies import (
    AutoTimeout,
    Backoff,
    BackoffStrategy,
    BreakerPolicy,
    BudgetPolicy,
    BulkheadPolicy,
    DlqRespond,
    HedgePolicy,
    NonIdempotent,
    RedrivePolicy,
    RetryAfter,
    RetryPolicy,
    RouteDlq,
    ThrottlePolicy,
    UpgradePolicy,
)
from sidecar.config.schema import key, section
from sidecar.config.telemetry import Telemetry
from sidecar.config.tls import RouteTls, ServerTls
from sidecar.config.values import (
    HEDGE_METHODS,
    IDEMPOTENT_METHODS,
    UPSTREAM_PROTOCOLS,
    IpNetwork,
    Listen,
    PathPattern,
    RetryOn,
    Upstream,
    UpstreamProtocol,
)

__all__ = [
    "HEDGE_METHODS",
    "IDEMPOTENT_METHODS",
    "UNLIMITED_SIZE",
    "Admin",
    "AutoTimeout",
    "Backoff",
    "BackoffStrategy",
    "BreakerPolicy",
    "BudgetPolicy",
    "BulkheadPolicy",
    "Config",
    "DlqFile",
    "DlqRespond",
    "FileKillSwitch",
    "HedgePolicy",
    "Http2",
    "IpNetwork",
    "Limits",
    "Listen",
    "Match",
    "NonIdempotent",
    "PathPattern",
    "RedrivePolicy",
    "RetryAfter",
    "RetryOn",
    "RetryPolicy",
    "Route",
    "RouteDlq",
    "ThrottlePolicy",
    "UpgradePolicy",
    "Upstream",
    "UpstreamPool",
]


@dataclass(frozen=True, slots=True)
class Match:
    path: str | None = key(None, c.url_path)
    path_prefix: str | None = key(None, c.url_path)
    path_regex: PathPattern | None = key(None, c.regex, show=lambda p: p and p.pattern)
    methods: frozenset[str] | None = key(None, c.methods)
    # (lower-case header name, exact value) pairs; all must be present (parsed by parse.py).
    headers: tuple[tuple[str, str], ...] = key((), None, own=True, show=dict)


@dataclass(frozen=True, slots=True)
class Route:
    name: str = key(
        check=c.route_name,
        required="required",
        help="letters, digits, `_ . -`; used as the metric label",
    )
    match: Match = key(
        check=None,
        own=True,
        default_doc="match all",
        help=(
            "`path` (exact), `path_prefix`, `path_regex` (full match, RE2 syntax as Envoy's "
            "`safe_regex`: matching time is linear in the path, so no path a client sends can "
            "make a pattern backtrack for hours; no lookaround or backreferences), `methods`, "
            "`headers` (exact values); all given must hold. Paths are matched on the raw target "
            "as sent, before `?`, without decoding; an absolute-form target (`GET "
            "http://host/path`) is matched by its path"
        ),
    )
    # one or more endpoints (a DNS name may add more)
    upstreams: tuple[Upstream, ...] = key(
        check=c.upstreams,
        yaml="upstream",
        required="required: the upstream URL, e.g. http://127.0.0.1:8080",
        show=lambda us: [str(u) for u in us],
        help=(
            "`http://host:port` or `https://host[:port]` (TLS, port 443 unless given; "
            "verified as the route's `tls` says), or a list of them: the route's endpoints (up "
            "to 64). A host name stands for every address it resolves to, re-resolved every "
            "`upstream_pool.dns_refresh`; a failed lookup keeps the addresses it had. Attempts "
            'take the endpoints in turn; see "Storm control"'
        ),
    )
    # The route timeout matches nginx's proxy_read_timeout (60 s): a slow answer the upstream
    # gives directly must not become a 504 through the sidecar.
    timeout: float = key(
        60.0,
        c.positive_duration,
        unit="duration",
        note="deadline of the whole retry sequence (nginx waits 60 s too)",
        help=(
            "deadline of the whole retry sequence, from when the request has been received: a "
            "buffered body included; for a streamed body (over `max_body_bytes`) it starts "
            "again once that body has been received, as Envoy's route timeout starts at the "
            "end of the request. It bounds the wait for the response head, not the relaying of "
            "its body (see `stream_idle_timeout`). 60 s as nginx's `proxy_read_timeout`: an "
            "answer slower than a few seconds that the upstream gives directly is not turned "
            "into a 504"
        ),
    )
    # The longest silence between two reads of a response body being relayed (after the head,
    # which per_try_timeout bounds); nginx's proxy_read_timeout, 60 s.
    stream_idle_timeout: float = key(
        60.0,
        c.positive_duration,
        unit="duration",
        note="longest silence while relaying a response body",
        help=(
            "the longest silence between two reads of a response body being relayed, after its "
            "head (nginx's `proxy_read_timeout`, 60 s); a body that stalls longer is cut. Per "
            "route like `timeout`"
        ),
    )
    upstream_protocol: UpstreamProtocol = key(
        "http1",
        c.Choice(UPSTREAM_PROTOCOLS),
        note="h2: HTTP/2 to the upstream (needed for gRPC); auto: by ALPN over https://",
        help=(
            "what the sidecar speaks to the route's upstreams: `http1` (HTTP/1.1, the default), "
            "`h2` (HTTP/2: h2c with prior knowledge over `http://`, h2 by ALPN over `https://`; "
            "what a gRPC call needs), or `auto` (over `https://` ALPN offers both and the "
            "upstream chooses; over `http://` it is `http1`). A client of either protocol is "
            'served by an upstream of either; see "HTTP/2 and gRPC"'
        ),
    )
    tls: RouteTls = section(
        RouteTls,
        note="for https:// upstreams: verified by default (chain and host name)",
        help=(
            "how `https://` upstreams are verified (`ca_file`, `server_name`, `verify`, "
            "`min_version`) and the client certificate for mutual TLS (`client_cert`, "
            '`client_key`); see "TLS"'
        ),
    )
    forward_client_cert: bool = key(
        False,
        c.boolean,
        note="true: X-Forwarded-Client-Cert (hash, subject) from a mutual-TLS listener",
        help=(
            "with a mutual-TLS listener (`server_tls.client_ca_file`): true adds "
            "`X-Forwarded-Client-Cert` as Envoy writes it (`Hash=<sha256 of the DER>;"
            'Subject="<RFC 4514 subject>"`), nothing else of the certificate; false (the '
            "default) sends nothing of it. One a client sends is always dropped"
        ),
    )
    retry: RetryPolicy = section(RetryPolicy, rows=True)
    breaker: BreakerPolicy = section(
        BreakerPolicy,
        note='for "down": sequences that failed after their whole policy',
        help='the breaker for "down"; see "Storm control"',
    )
    budget: BudgetPolicy = section(
        BudgetPolicy, flow=True, help='the retry budget; see "Storm control"'
    )
    throttle: ThrottlePolicy = section(
        ThrottlePolicy,
        flow=True,
        note="retries and hedges only",
        help='adaptive throttling of retries and hedges; see "Storm control"',
    )
    hedge: HedgePolicy = section(
        HedgePolicy,
        flow=True,
        note=(
            "Hedging is opt-in per route: a hedge is a second copy of a request still in "
            "progress.\nOnly the methods listed (idempotent ones only), never a request with an "
            "Idempotency-Key.\n"
        ),
        help=(
            "hedged requests, opt-in per route, and their budget; `methods`: what a route that "
            "turns hedging on hedges (idempotent methods only, and `POST` for gRPC calls only; "
            'never a request with an `Idempotency-Key`); see "Storm control"'
        ),
    )
    bulkhead: BulkheadPolicy = section(
        BulkheadPolicy,
        flow=True,
        help=(
            "the bulkhead and the adaptive concurrency limit, opt-in (`adaptive: true`) as "
            "Envoy's: it reads long-polls and slow handlers as overload and would refuse them; "
            'see "Storm control"'
        ),
    )
    upgrade: UpgradePolicy = section(
        UpgradePolicy,
        flow=True,
        note="WebSocket & co: tunnelled, cut after 1 h idle",
        help=(
            'HTTP Upgrade (WebSocket, any protocol): see "Upgrades (WebSocket)". `idle_timeout`: '
            "a tunnel with no byte either way for this long is closed (Envoy's TCP proxy idle "
            "timeout; nginx cuts at its `proxy_read_timeout`, 60 s). `enabled: false` sends an "
            "upgrade request as an ordinary request without `Upgrade`, as nginx without upgrade "
            "configuration does, and the app answers it (a WebSocket server: 426 or 400)"
        ),
    )
    idempotency: IdempotencyPolicy = section(
        IdempotencyPolicy,
        help=(
            "`Idempotency-Key` enforced for the app: a guarded write (`methods`) with a key "
            "reaches the app once; its answer is kept `ttl` and replayed; `required`: no key "
            "gets 400; `lease` (null: the route's `timeout` + 5 s): how long a key stays in "
            "progress if its sidecar dies; answers over `max_response_bytes` are relayed, not "
            "kept; `scope_header`: keys scoped by a hash of that header; `on_store_error`: "
            '`refuse` (503) or `pass` (forward unguarded). See "Effectively-once writes"'
        ),
    )
    dlq: RouteDlq = section(
        RouteDlq,
        help=(
            'see "Dead-letter queue"; `drop_headers` lists header names (any case) never stored '
            "with a record, beyond the credentials; a route's list replaces the default's"
        ),
    )

    @property
    def upstream(self) -> Upstream:
        """The first endpoint: its authority is the Host of an HTTP/1.0 request without one."""
        return self.upstreams[0]


@dataclass(frozen=True, slots=True)
class Admin:
    listen: Listen = key(Listen("127.0.0.1", 15000), c.listen, live=False)  # bound at start
    # read from the environment at start
    token_env: str | None = key("RETRY_SIDECAR_ADMIN_TOKEN", c.env_name, live=False)
    # Host names (lower case, no port) the admin listener answers besides the loopback names,
    # its listen address and the address a connection arrived at (sidecar.admin.origin); the
    # admin guard reads it for every request.
    allowed_hosts: tuple[str, ...] = key(
        (),
        c.host_names,
        note=(
            "Host names the admin API answers besides localhost, loopback addresses, the listen "
            "address\nand the address a connection arrived at (a DNS-rebinding page sends a name "
            "nobody listed).\n"
        ),
    )


@dataclass(frozen=True, slots=True)
class UpstreamPool:
    """The pooled keep-alive connections to each upstream (host, port)."""

    # The pools are built at start: every key but dns_refresh needs a restart.
    max_connections: int = key(1024, c.int_range(1, 100_000), live=False)
    # waiting for a free connection, separate from connecting
    wait_timeout: float = key(
        1.0,
        c.duration,
        unit="duration",
        live=False,
        note="for a free connection (then 503 pool-exhausted)",
    )
    connect_timeout: float = key(1.0, c.positive_duration, unit="duration", live=False)
    # Closed after this long unused. Keep it below the upstream's own keep-alive timeout
    # (Node.js 5 s, gunicorn 2 s, nginx 75 s), so the upstream never closes a connection
    # just as the sidecar reuses it.
    idle_timeout: float = key(
        4.0,
        c.positive_duration,
        unit="duration",
        live=False,
        note="keep below the upstream's own keep-alive timeout",
    )
    # Upstream host names are resolved to all their addresses (each one an endpoint) and
    # re-resolved this often.
    dns_refresh: float = key(
        5.0,
        c.positive_duration,
        unit="duration",
        note="upstream host names: every address is an endpoint, re-resolved",
    )


_ROUTES_EXAMPLE = """
  - name: orders
    match: {path_prefix: /orders, methods: [GET, POST]}
    # match also takes path: /exact, path_regex: "/v[0-9]+/.*" (RE2, whole path) and
    # headers: {x-tenant: blue} (exact values); every one given must hold. Default: all.
    upstream: "http://127.0.0.1:8080"
    retry: {attempts: 4}
    dlq: {enabled: true}
  - name: default
    match: {path_prefix: /}
    upstream: "http://127.0.0.1:8080"   # or a list: ["http://10.0.0.1:8080", "http://10.0.0.2:8080"]"""


@dataclass(frozen=True, slots=True)
class Config:
    version: int = key(
        check=c.int_range(1, 1),
        required="required (the only supported version is 1)",
        example="1",
        help="must be `1`",
    )
    name: str = key(
        check=c.name,
        factory=socket.gethostname,
        default_doc="hostname",
        example='"orders-sidecar"',
        note="sent upstream in x-retry-edge (default: the hostname)",
        help="this sidecar's name, sent upstream in `x-retry-edge`",
    )
    listen: Listen = key(
        Listen("0.0.0.0", 15001),
        c.listen,
        live=False,  # the proxy socket is bound at start
        example='"127.0.0.1:15001"',
        note="the proxy listener; use 0.0.0.0:15001 in a container",
        help="proxy listener, `host:port` (IP address or `localhost`)",
    )
    server_tls: ServerTls = section(
        ServerTls,
        note="set cert_file and key_file: the proxy listener speaks TLS",
        help=(
            "the proxy listener over TLS: `cert_file` and `key_file` (re-read when they change), "
            '`client_ca_file` for mutual TLS, `min_version`; see "TLS"'
        ),
    )
    admin: Admin = section(
        Admin,
        help=(
            'see "Operating it"; `allowed_hosts`: host names (no port) the admin API answers '
            "besides loopback names and addresses, the listen address and the address a "
            "connection arrived at"
        ),
    )
    trusted_peers: tuple[IpNetwork, ...] = key(
        c.networks(["127.0.0.0/8", "::1/128"]),
        c.networks,
        flow=True,
        note="peers whose x-retry-* headers are honoured",
        help="peers whose `x-retry-edge` / `x-request-timeout-ms` are obeyed",
    )
    dlq: DlqFile = section(
        DlqFile,
        help=(
            "where the DLQ keeps its records and their bounds: `backend` `sqlite` (the file at "
            '`path`) or `redis` (`fleet.redis`, one stream per route; see "Fleet mode")'
        ),
    )
    idempotency: IdempotencyStorage = section(
        IdempotencyStorage,
        flow=True,
        help="where the idempotency keys are kept: `sqlite` (at `path`) or `redis` (`fleet.redis`)",
    )
    fleet: Fleet = section(Fleet, rows=True)
    limits: Limits = section(Limits, rows=True)
    http2: Http2 = section(
        Http2,
        rows=True,
        help="HTTP/2 clients on the proxy listener (h2c with prior knowledge, h2 by ALPN)",
    )
    telemetry: Telemetry = section(Telemetry, rows=True)
    drain_timeout: float = key(
        20.0,  # applies to the next drain
        c.duration,
        unit="duration",
        help="how long in-flight requests get after SIGTERM",
    )
    # One process per sidecar, decided: several workers would each keep their own breaker,
    # budget, kill switch and DLQ writer, silently dividing every threshold. Scale with
    # replicas (each its own sidecar) instead.
    workers: int = key(
        1,
        c.only_one_worker,
        note="only 1: one process per sidecar; scale with replicas",
        help=(
            "only 1: one process per sidecar (breaker, budget, kill switch and DLQ are per "
            "process); scale with replicas"
        ),
    )
    upstream_pool: UpstreamPool = section(
        UpstreamPool,
        note="keep-alive connections to each upstream",
        help=(
            "keep-alive connections per upstream endpoint; `wait_timeout` bounds the wait for a "
            "free one (then 503 `pool-exhausted`; a wait that the attempt's own time -- per-try "
            "timeout or deadline -- ends first is no time left, as for the bulkhead: 504 "
            "`deadline` once the deadline is spent), separate from `connect_timeout`; keep "
            "`idle_timeout` below the upstream's own keep-alive timeout; `dns_refresh`: how "
            "often upstream host names are looked up again. Changes need a restart "
            "(`dns_refresh` applies at once)"
        ),
    )
    # File kill switches are re-applied on every (re)load.
    killswitches: tuple[FileKillSwitch, ...] = key(
        (),
        None,
        own=True,
        example=(
            '[]\n#  - scope: route:orders          # or "global"\n'
            '#    reason: "INC-123 retries amplify the outage"\n'
            "#    until: 2025-06-01T12:00:00Z  # RFC 3339, with Z or an offset"
        ),
        note=(
            "Fleet-wide kill switches: retries off (one attempt) for a scope until a time. "
            "Applied on every\n(re)load, so one ConfigMap edit reaches every pod; delete the "
            "entry to lift it everywhere.\nAn entry whose `until` has passed is ignored with a "
            "warning.\n"
        ),
        help=(
            "fleet-wide kill switches: a list of `{scope: global \\| route:<name>, reason, "
            'until: <RFC 3339 time>}`; see "In an incident"'
        ),
    )
    routes: tuple[Route, ...] = key(
        (),
        None,
        own=True,
        required="required: at least one route",
        example=_ROUTES_EXAMPLE,
        note="first match wins",
        help=(
            "the routes, first match wins; each takes the keys below. Every key below but "
            "`name`, `match` and `upstream` may also be set in `defaults`, which every route "
            "inherits"
        ),
    )
    source: str = "<memory>"
    sha256: str = ""
    # Valid but surprising (dead config inherited from ``defaults``), each with its line and
    # the fix: ``validate`` prints them, a load logs them; they change nothing.
    warnings: tuple[ConfigIssue, ...] = ()

    def route(self, name: str) -> Route | None:
        for r in self.routes:
            if r.name == name:
                return r
        return None

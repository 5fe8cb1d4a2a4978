"""YAML text -> ``Config``. Every problem is collected with its key path and line.

Routes inherit ``defaults``; a route overrides any key, section by section (``retry: {attempts: 4}``
changes only ``attempts``). Each value is validated where it is written, so an error points at the
line that holds it.
"""

from __future__ import annotations

import errno
import hashlib
import ipaddress
import os
import re
import socket
import stat
from collections.abc import Callable
from dataclasses import replace
from typing import Any, TypeVar
from urllib.parse import urlsplit

from sidecar import outcomes
from sidecar.config import killswitches, units
from sidecar.config.errors import ConfigError, ConfigIssue
from sidecar.config.model import (
    IDEMPOTENT_METHODS,
    Admin,
    AutoTimeout,
    Backoff,
    BreakerPolicy,
    BudgetPolicy,
    BulkheadPolicy,
    Config,
    DlqFile,
    HedgePolicy,
    IpNetwork,
    Limits,
    Listen,
    Match,
    PathPattern,
    RedrivePolicy,
    RetryAfter,
    RetryOn,
    RetryPolicy,
    Route,
    RouteDlq,
    ThrottlePolicy,
    UpgradePolicy,
    Upstream,
    UpstreamPool,
)
from sidecar.config.yamlnodes import (
    MAX_DOCUMENT_BYTES,
    Located,
    Path,
    YamlLoadError,
    load,
    path_str,
)
from sidecar.outcomes import OutcomeKind

T = TypeVar("T")

BACKOFF_STRATEGIES = (
    "full_jitter",
    "equal_jitter",
    "decorrelated_jitter",
    "exponential",
    "constant",
)
NON_IDEMPOTENT = ("never", "with-idempotency-key", "always")
HTTP_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"}
)
ROUTE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_ATTEMPTS = 10
MAX_UPSTREAMS = 64
ROUTE_SECTIONS = (
    "timeout",
    "stream_idle_timeout",
    "retry",
    "breaker",
    "budget",
    "bulkhead",
    "throttle",
    "hedge",
    "upgrade",
    "dlq",
)
DEFAULT_TRUSTED = ("127.0.0.0/8", "::1/128")


class _Invalid(Exception):
    """Raised inside a field check; turned into a ConfigIssue by the caller."""


class _Parser:
    def __init__(self, located: Located) -> None:
        self.located = located
        self.issues: list[ConfigIssue] = []

    # -- helpers ---------------------------------------------------------------------------

    def error(self, path: Path, message: str) -> None:
        self.issues.append(ConfigIssue(self.located.line(path), path_str(path), message))

    def mapping(self, value: object, path: Path, allowed: tuple[str, ...]) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, dict):
            self.error(path, f"expected a mapping, got {_kind(value)}")
            return {}
        for key in value:
            if key not in allowed:
                self.error((*path, key), f"unknown key (allowed: {', '.join(allowed)})")
        return {k: v for k, v in value.items() if k in allowed}

    def field(
        self, raw: dict[str, Any], key: str, path: Path, check: Callable[[object], T], default: T
    ) -> T:
        if key not in raw:
            return default
        try:
            return check(raw[key])
        except (_Invalid, units.UnitError) as exc:
            self.error((*path, key), str(exc))
            return default

    # -- sections --------------------------------------------------------------------------

    def retry(self, value: object, path: Path, base: RetryPolicy) -> RetryPolicy:
        raw = self.mapping(
            value,
            path,
            (
                "attempts",
                "per_try_timeout",
                "auto_timeout",
                "backoff",
                "retry_on",
                "retry_after",
                "non_idempotent",
                "max_body_bytes",
            ),
        )
        backoff = base.backoff
        if "backoff" in raw:
            backoff = self.backoff(raw["backoff"], (*path, "backoff"), base.backoff)
        retry_after = base.retry_after
        if "retry_after" in raw:
            ra = self.mapping(raw["retry_after"], (*path, "retry_after"), ("honor", "max"))
            retry_after = RetryAfter(
                honor=self.field(ra, "honor", (*path, "retry_after"), _bool, retry_after.honor),
                max=self.field(
                    ra, "max", (*path, "retry_after"), _positive_duration, retry_after.max
                ),
            )
        auto = base.auto_timeout
        if "auto_timeout" in raw:
            auto = self.auto_timeout(raw["auto_timeout"], (*path, "auto_timeout"), auto)
        policy = RetryPolicy(
            attempts=self.field(raw, "attempts", path, _int_range(1, MAX_ATTEMPTS), base.attempts),
            per_try_timeout=self.field(
                raw, "per_try_timeout", path, _auto_or_duration, base.per_try_timeout
            ),
            auto_timeout=auto,
            backoff=backoff,
            retry_on=self.field(raw, "retry_on", path, _retry_on, base.retry_on),
            retry_after=retry_after,
            non_idempotent=self.field(
                raw, "non_idempotent", path, _choice(NON_IDEMPOTENT), base.non_idempotent
            ),
            max_body_bytes=self.field(
                raw, "max_body_bytes", path, units.parse_size, base.max_body_bytes
            ),
        )
        return policy

    def auto_timeout(self, value: object, path: Path, base: AutoTimeout) -> AutoTimeout:
        raw = self.mapping(value, path, ("percentile", "multiplier", "min", "max"))
        result = AutoTimeout(
            percentile=self.field(raw, "percentile", path, _percentile, base.percentile),
            multiplier=self.field(raw, "multiplier", path, _at_least(1.0), base.multiplier),
            min=self.field(raw, "min", path, _positive_duration, base.min),
            max=self.field(raw, "max", path, _positive_duration, base.max),
        )
        if result.max < result.min:
            self.error((*path, "max"), f"must be at least min ({result.min}s)")
        return result

    def backoff(self, value: object, path: Path, base: Backoff) -> Backoff:
        raw = self.mapping(value, path, ("strategy", "base", "max"))
        result = Backoff(
            strategy=self.field(raw, "strategy", path, _choice(BACKOFF_STRATEGIES), base.strategy),
            base=self.field(raw, "base", path, _duration, base.base),
            max=self.field(raw, "max", path, _duration, base.max),
        )
        if result.max < result.base:
            self.error((*path, "max"), f"must be at least base ({result.base}s)")
        return result

    def breaker(self, value: object, path: Path, base: BreakerPolicy) -> BreakerPolicy:
        raw = self.mapping(
            value,
            path,
            (
                "enabled",
                "failure_ratio",
                "min_sequences",
                "window",
                "open_for",
                "max_open_for",
                "half_open_probes",
                "ramp",
            ),
        )
        result = BreakerPolicy(
            enabled=self.field(raw, "enabled", path, _bool, base.enabled),
            failure_ratio=self.field(raw, "failure_ratio", path, _ratio, base.failure_ratio),
            min_sequences=self.field(
                raw, "min_sequences", path, _int_range(1, 1_000_000), base.min_sequences
            ),
            window=self.field(raw, "window", path, _positive_duration, base.window),
            open_for=self.field(raw, "open_for", path, _positive_duration, base.open_for),
            max_open_for=self.field(
                raw, "max_open_for", path, _positive_duration, base.max_open_for
            ),
            half_open_probes=self.field(
                raw, "half_open_probes", path, _int_range(1, 1000), base.half_open_probes
            ),
            ramp=self.field(raw, "ramp", path, _duration, base.ramp),
        )
        if "max_open_for" in raw and result.max_open_for < result.open_for:
            self.error((*path, "max_open_for"), f"must be at least open_for ({result.open_for:g}s)")
        # An open_for written above an inherited max_open_for: it does not grow, then.
        return replace(result, max_open_for=max(result.max_open_for, result.open_for))

    def budget(self, value: object, path: Path, base: BudgetPolicy) -> BudgetPolicy:
        raw = self.mapping(value, path, ("ratio", "min_per_second", "window"))
        return BudgetPolicy(
            ratio=self.field(raw, "ratio", path, _non_negative_number, base.ratio),
            min_per_second=self.field(
                raw, "min_per_second", path, _non_negative_number, base.min_per_second
            ),
            window=self.field(raw, "window", path, _positive_duration, base.window),
        )

    def bulkhead(self, value: object, path: Path, base: BulkheadPolicy) -> BulkheadPolicy:
        raw = self.mapping(
            value, path, ("max_concurrent", "queue_timeout", "adaptive", "min_concurrent")
        )
        result = BulkheadPolicy(
            max_concurrent=self.field(
                raw, "max_concurrent", path, _int_range(1, 1_000_000), base.max_concurrent
            ),
            queue_timeout=self.field(raw, "queue_timeout", path, _duration, base.queue_timeout),
            adaptive=self.field(raw, "adaptive", path, _bool, base.adaptive),
            min_concurrent=self.field(
                raw, "min_concurrent", path, _int_range(1, 1_000_000), base.min_concurrent
            ),
        )
        if "min_concurrent" in raw and result.min_concurrent > result.max_concurrent:
            self.error(
                (*path, "min_concurrent"),
                f"must not exceed max_concurrent ({result.max_concurrent})",
            )
        # An inherited minimum above a smaller max_concurrent written here is clamped to it.
        return replace(result, min_concurrent=min(result.min_concurrent, result.max_concurrent))

    def throttle(self, value: object, path: Path, base: ThrottlePolicy) -> ThrottlePolicy:
        raw = self.mapping(value, path, ("enabled", "k", "window", "min_requests"))
        return ThrottlePolicy(
            enabled=self.field(raw, "enabled", path, _bool, base.enabled),
            k=self.field(raw, "k", path, _at_least(1.0), base.k),
            window=self.field(raw, "window", path, _positive_duration, base.window),
            min_requests=self.field(
                raw, "min_requests", path, _int_range(0, 1_000_000), base.min_requests
            ),
        )

    def hedge(self, value: object, path: Path, base: HedgePolicy) -> HedgePolicy:
        raw = self.mapping(value, path, ("enabled", "methods", "ratio", "min_per_second", "window"))
        return HedgePolicy(
            enabled=self.field(raw, "enabled", path, _bool, base.enabled),
            methods=self.field(raw, "methods", path, _hedge_methods, base.methods),
            ratio=self.field(raw, "ratio", path, _non_negative_number, base.ratio),
            min_per_second=self.field(
                raw, "min_per_second", path, _non_negative_number, base.min_per_second
            ),
            window=self.field(raw, "window", path, _positive_duration, base.window),
        )

    def upgrade(self, value: object, path: Path, base: UpgradePolicy) -> UpgradePolicy:
        raw = self.mapping(value, path, ("enabled", "idle_timeout"))
        return UpgradePolicy(
            enabled=self.field(raw, "enabled", path, _bool, base.enabled),
            idle_timeout=self.field(
                raw, "idle_timeout", path, _positive_duration, base.idle_timeout
            ),
        )

    def route_dlq(self, value: object, path: Path, base: RouteDlq) -> RouteDlq:
        raw = self.mapping(
            value,
            path,
            (
                "enabled",
                "respond",
                "keep_credentials",
                "max_replays",
                "replay_rate",
                "redrive",
                "drop_headers",
            ),
        )
        redrive = base.redrive
        if "redrive" in raw:
            rd = self.mapping(raw["redrive"], (*path, "redrive"), ("enabled", "interval"))
            redrive = RedrivePolicy(
                enabled=self.field(rd, "enabled", (*path, "redrive"), _bool, redrive.enabled),
                interval=self.field(
                    rd, "interval", (*path, "redrive"), _positive_duration, redrive.interval
                ),
            )
        return RouteDlq(
            enabled=self.field(raw, "enabled", path, _bool, base.enabled),
            respond=self.field(
                raw, "respond", path, _choice(("passthrough", "accepted")), base.respond
            ),
            keep_credentials=self.field(
                raw, "keep_credentials", path, _bool, base.keep_credentials
            ),
            max_replays=self.field(raw, "max_replays", path, _int_range(1, 1000), base.max_replays),
            replay_rate=self.field(raw, "replay_rate", path, _positive_number, base.replay_rate),
            redrive=redrive,
            drop_headers=self.field(raw, "drop_headers", path, _header_names, base.drop_headers),
        )

    def match(self, value: object, path: Path) -> Match:
        raw = self.mapping(value, path, ("path", "path_prefix", "path_regex", "methods", "headers"))
        headers: tuple[tuple[str, str], ...] = ()
        if "headers" in raw:
            hraw = raw["headers"]
            if not isinstance(hraw, dict):
                self.error((*path, "headers"), "expected a mapping of header name to exact value")
            else:
                pairs = []
                for name, val in hraw.items():
                    if not isinstance(val, str | int) or isinstance(val, bool):
                        self.error((*path, "headers", name), "expected a string value")
                        continue
                    pairs.append((str(name).lower(), str(val)))
                headers = tuple(pairs)
        return Match(
            path=self.field(raw, "path", path, _url_path, None),
            path_prefix=self.field(raw, "path_prefix", path, _url_path, None),
            path_regex=self.field(raw, "path_regex", path, _regex, None),
            methods=self.field(raw, "methods", path, _methods, None),
            headers=headers,
        )

    # -- top level -------------------------------------------------------------------------

    def config(self, source: str, sha: str) -> Config | None:
        data = self.located.data
        if data is None:
            self.error((), "the file is empty")
            return None
        top = self.mapping(
            data,
            (),
            (
                "version",
                "name",
                "listen",
                "admin",
                "trusted_peers",
                "dlq",
                "limits",
                "drain_timeout",
                "upstream_pool",
                "workers",
                "defaults",
                "routes",
                "killswitches",
            ),
        )
        if "version" not in top:
            self.error(("version",), "required (the only supported version is 1)")
        else:
            self.field(top, "version", (), _int_range(1, 1), 1)
        name = self.field(top, "name", (), _name, socket.gethostname())
        listen = self.field(top, "listen", (), _listen, Listen("0.0.0.0", 15001))

        araw = self.mapping(top.get("admin"), ("admin",), ("listen", "token_env", "allowed_hosts"))
        admin = Admin(
            listen=self.field(araw, "listen", ("admin",), _listen, Admin().listen),
            token_env=self.field(araw, "token_env", ("admin",), _env_name, Admin().token_env),
            allowed_hosts=self.field(
                araw, "allowed_hosts", ("admin",), _host_names, Admin().allowed_hosts
            ),
        )
        trusted = self.field(
            top, "trusted_peers", (), _networks, tuple(_networks(list(DEFAULT_TRUSTED)))
        )
        draw = self.mapping(top.get("dlq"), ("dlq",), ("path", "max_records", "max_bytes"))
        dlq = DlqFile(
            path=self.field(draw, "path", ("dlq",), _non_empty_str, DlqFile().path),
            max_records=self.field(
                draw, "max_records", ("dlq",), _int_range(1, 100_000_000), DlqFile().max_records
            ),
            max_bytes=self.field(
                draw, "max_bytes", ("dlq",), units.parse_size, DlqFile().max_bytes
            ),
        )
        lraw = self.mapping(
            top.get("limits"),
            ("limits",),
            (
                "max_header_bytes",
                "header_timeout",
                "body_idle_timeout",
                "keepalive_timeout",
                "max_request_body",
                "send_timeout",
            ),
        )
        d = Limits()
        limits = Limits(
            max_header_bytes=self.field(
                lraw, "max_header_bytes", ("limits",), units.parse_size, d.max_header_bytes
            ),
            header_timeout=self.field(
                lraw, "header_timeout", ("limits",), _positive_duration, d.header_timeout
            ),
            body_idle_timeout=self.field(
                lraw, "body_idle_timeout", ("limits",), _positive_duration, d.body_idle_timeout
            ),
            max_request_body=self.field(
                lraw,
                "max_request_body",
                ("limits",),
                units.parse_size_or_unlimited,
                d.max_request_body,
            ),
            keepalive_timeout=self.field(
                lraw, "keepalive_timeout", ("limits",), _positive_duration, d.keepalive_timeout
            ),
            send_timeout=self.field(
                lraw, "send_timeout", ("limits",), _positive_duration, d.send_timeout
            ),
        )
        drain = self.field(top, "drain_timeout", (), _duration, 20.0)
        praw = self.mapping(
            top.get("upstream_pool"),
            ("upstream_pool",),
            ("max_connections", "wait_timeout", "connect_timeout", "idle_timeout", "dns_refresh"),
        )
        pd = UpstreamPool()
        pp: Path = ("upstream_pool",)
        pool = UpstreamPool(
            max_connections=self.field(
                praw, "max_connections", pp, _int_range(1, 100_000), pd.max_connections
            ),
            wait_timeout=self.field(praw, "wait_timeout", pp, _duration, pd.wait_timeout),
            connect_timeout=self.field(
                praw, "connect_timeout", pp, _positive_duration, pd.connect_timeout
            ),
            idle_timeout=self.field(praw, "idle_timeout", pp, _positive_duration, pd.idle_timeout),
            dns_refresh=self.field(praw, "dns_refresh", pp, _positive_duration, pd.dns_refresh),
        )
        # One process per sidecar, decided: several workers would each keep their own breaker,
        # budget, kill switch and DLQ writer, silently dividing every threshold. Scale with
        # replicas (each its own sidecar) instead.
        self.field(top, "workers", (), _only_one_worker, 1)

        defaults = self.defaults(top.get("defaults"))
        routes = self.routes(top.get("routes"), defaults)
        switches = killswitches.parse_section(
            top.get("killswitches"), self.located, {r.name for r in routes}, self.error
        )
        if self.issues:
            return None
        return Config(
            version=1,
            name=name,
            listen=listen,
            admin=admin,
            trusted_peers=trusted,
            dlq=dlq,
            limits=limits,
            drain_timeout=drain,
            upstream_pool=pool,
            routes=tuple(routes),
            killswitches=switches,
            source=source,
            sha256=sha,
        )

    def defaults(self, value: object) -> dict[str, Any]:
        path: Path = ("defaults",)
        raw = self.mapping(value, path, ROUTE_SECTIONS)
        return self.route_sections(raw, path, _DEFAULT_SECTIONS)

    def route_sections(
        self, raw: dict[str, Any], path: Path, base: dict[str, Any]
    ) -> dict[str, Any]:
        out = dict(base)
        out["timeout"] = self.field(raw, "timeout", path, _positive_duration, base["timeout"])
        out["stream_idle_timeout"] = self.field(
            raw, "stream_idle_timeout", path, _positive_duration, base["stream_idle_timeout"]
        )
        if "retry" in raw:
            out["retry"] = self.retry(raw["retry"], (*path, "retry"), base["retry"])
        if "breaker" in raw:
            out["breaker"] = self.breaker(raw["breaker"], (*path, "breaker"), base["breaker"])
        if "budget" in raw:
            out["budget"] = self.budget(raw["budget"], (*path, "budget"), base["budget"])
        if "bulkhead" in raw:
            out["bulkhead"] = self.bulkhead(raw["bulkhead"], (*path, "bulkhead"), base["bulkhead"])
        if "throttle" in raw:
            out["throttle"] = self.throttle(raw["throttle"], (*path, "throttle"), base["throttle"])
        if "hedge" in raw:
            out["hedge"] = self.hedge(raw["hedge"], (*path, "hedge"), base["hedge"])
        if "upgrade" in raw:
            out["upgrade"] = self.upgrade(raw["upgrade"], (*path, "upgrade"), base["upgrade"])
        if "dlq" in raw:
            out["dlq"] = self.route_dlq(raw["dlq"], (*path, "dlq"), base["dlq"])
        return out

    def routes(self, value: object, defaults: dict[str, Any]) -> list[Route]:
        if value is None:
            self.error(("routes",), "required: at least one route")
            return []
        if not isinstance(value, list):
            self.error(("routes",), f"expected a list of routes, got {_kind(value)}")
            return []
        if not value:
            self.error(("routes",), "at least one route is required")
        routes: list[Route] = []
        seen: dict[str, int] = {}
        for i, item in enumerate(value):
            path: Path = ("routes", i)
            raw = self.mapping(item, path, ("name", "match", "upstream", *ROUTE_SECTIONS))
            if not isinstance(item, dict):
                continue
            name = None
            if "name" not in raw:
                self.error((*path, "name"), "required")
            else:
                name = self.field(raw, "name", path, _route_name, None)
                if name is not None and name in seen:
                    self.error((*path, "name"), f"duplicate route name (also routes[{seen[name]}])")
                elif name is not None:
                    seen[name] = i
            upstream = None
            if "upstream" not in raw:
                self.error(
                    (*path, "upstream"), "required: the upstream URL, e.g. http://127.0.0.1:8080"
                )
            else:
                upstream = self.field(raw, "upstream", path, _upstreams, None)
            match = self.match(raw.get("match"), (*path, "match"))
            sections = self.route_sections(raw, path, defaults)
            if name is None or upstream is None:
                continue
            routes.append(
                Route(
                    name=name,
                    match=match,
                    upstreams=upstream,
                    timeout=sections["timeout"],
                    stream_idle_timeout=sections["stream_idle_timeout"],
                    retry=sections["retry"],
                    breaker=sections["breaker"],
                    budget=sections["budget"],
                    bulkhead=sections["bulkhead"],
                    dlq=sections["dlq"],
                    throttle=sections["throttle"],
                    hedge=sections["hedge"],
                    upgrade=sections["upgrade"],
                )
            )
        return routes


# The route timeout matches nginx's proxy_read_timeout (60 s): a slow answer the upstream gives
# directly must not become a 504 through the sidecar.
DEFAULT_TIMEOUT = 60.0
_DEFAULT_SECTIONS: dict[str, Any] = {
    "timeout": DEFAULT_TIMEOUT,
    # nginx's proxy_read_timeout: the longest silence between two reads of a response body.
    "stream_idle_timeout": 60.0,
    "retry": RetryPolicy(),
    "breaker": BreakerPolicy(),
    "budget": BudgetPolicy(),
    "bulkhead": BulkheadPolicy(),
    "throttle": ThrottlePolicy(),
    "hedge": HedgePolicy(),
    "upgrade": UpgradePolicy(),
    "dlq": RouteDlq(),
}


# -- field checks: each takes the raw YAML value and returns the typed one or raises ----------


def _kind(value: object) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def _bool(value: object) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {value!r}")
    return value


def _int_range(lo: int, hi: int) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"expected a whole number from {lo} to {hi}, got {value!r}")
        if not lo <= value <= hi:
            raise _Invalid(f"must be from {lo} to {hi}, got {value}")
        return value

    return check


# No ratio, rate, multiplier or factor of the config needs more; a bigger one overflowed
# arithmetic (a budget's min_per_second of 1e308 times its window is inf).
MAX_NUMBER = 1e9


def _number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"expected a number, got {value!r}")
    if isinstance(value, int) and abs(value) > MAX_NUMBER:  # before float(), which overflows
        raise _Invalid(f"must be at most {MAX_NUMBER:g}, got {value!r}")
    f = float(value)
    if f != f or f in (float("inf"), float("-inf")):
        raise _Invalid(f"expected a finite number, got {value!r}")
    if abs(f) > MAX_NUMBER:
        raise _Invalid(f"must be at most {MAX_NUMBER:g}, got {value!r}")
    return f


def _non_negative_number(value: object) -> float:
    f = _number(value)
    if f < 0:
        raise _Invalid(f"must not be negative, got {value}")
    return f


def _positive_number(value: object) -> float:
    f = _number(value)
    if f <= 0:
        raise _Invalid(f"must be greater than 0, got {value}")
    return f


def _ratio(value: object) -> float:
    f = _number(value)
    if not 0 < f <= 1:
        raise _Invalid(f"must be greater than 0 and at most 1, got {value}")
    return f


def _duration(value: object) -> float:
    return units.parse_duration(value)


def _auto_or_duration(value: object) -> float | None:
    """``auto`` (None: the adaptive per-try timeout) or a positive duration."""
    if value == "auto":
        return None
    try:
        return _positive_duration(value)
    except units.UnitError as exc:
        raise _Invalid(f"{exc} (or auto)") from None


def _percentile(value: object) -> float:
    f = _number(value)
    if not 0 < f < 1:
        raise _Invalid(f"must be between 0 and 1 (0.95 is the 95th percentile), got {value}")
    return f


def _at_least(lo: float) -> Callable[[object], float]:
    def check(value: object) -> float:
        f = _number(value)
        if f < lo:
            raise _Invalid(f"must be at least {lo:g}, got {value}")
        return f

    return check


def _positive_duration(value: object) -> float:
    d = units.parse_duration(value)
    if d <= 0:
        raise _Invalid(f"must be greater than 0, got {value!r}")
    return d


def _choice(options: tuple[str, ...]) -> Callable[[object], Any]:
    def check(value: object) -> str:
        if value not in options:
            raise _Invalid(f"must be one of {', '.join(options)}; got {value!r}")
        assert isinstance(value, str)
        return value

    return check


def _non_empty_str(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise _Invalid(f"expected a non-empty string, got {value!r}")
    return value


def _name(value: object) -> str:
    s = _non_empty_str(value)
    if not all(33 <= ord(c) < 127 for c in s) or len(s) > 128:
        raise _Invalid("must be 1-128 visible ASCII characters (it is sent in a header)")
    return s


def _route_name(value: object) -> str:
    if not isinstance(value, str) or not ROUTE_NAME.match(value):
        raise _Invalid(
            "must be 1-63 characters of letters, digits, '_', '.', '-', starting with a letter "
            f"or digit (it is a metric label); got {value!r}"
        )
    return value


def _env_name(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", value):
        raise _Invalid(f"expected an environment variable name, got {value!r}")
    return value


def _listen(value: object) -> Listen:
    if not isinstance(value, str):
        raise _Invalid(f"expected 'host:port', got {value!r}")
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise _Invalid(f"expected 'host:port' like '0.0.0.0:15001', got {value!r}")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise _Invalid(f"the host must be an IP address or 'localhost', got {host!r}") from None
    port = int(port_s)
    if port > 65535:
        raise _Invalid(f"port must be at most 65535, got {port}")
    return Listen(host, port)


HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$"
)


def _host_names(value: object) -> tuple[str, ...]:
    """``admin.allowed_hosts``: DNS names or IP addresses, as a Host header names them (without
    the port); compared without regard to case."""
    if not isinstance(value, list):
        raise _Invalid("expected a list of host names like 'retry-sidecar-admin.shop.svc'")
    out = []
    for item in value:
        name = str(item).lower().rstrip(".") if isinstance(item, str) else ""
        try:
            out.append(str(ipaddress.ip_address(name.strip("[]"))))
            continue
        except ValueError:
            pass
        if not HOST_NAME.match(name):
            raise _Invalid(
                f"not a host name or IP address (no port, no scheme, no wildcard): {item!r}"
            )
        out.append(name)
    return tuple(out)


def _networks(value: object) -> tuple[IpNetwork, ...]:
    if not isinstance(value, list):
        raise _Invalid("expected a list of CIDR ranges like '127.0.0.0/8'")
    out = []
    for item in value:
        try:
            out.append(ipaddress.ip_network(str(item), strict=False))
        except ValueError:
            raise _Invalid(f"not a CIDR range: {item!r}") from None
    return tuple(out)


def _upstream(value: object) -> Upstream:
    if not isinstance(value, str):
        raise _Invalid(f"expected a URL like 'http://127.0.0.1:8080', got {value!r}")
    parts = urlsplit(value)
    if parts.scheme != "http":
        raise _Invalid(
            "only plain http:// upstreams are supported (a sidecar talks to its local app); "
            f"got {value!r}"
        )
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise _Invalid(f"the upstream URL must be scheme://host:port only, got {value!r}")
    if not parts.hostname:
        raise _Invalid(f"the upstream URL has no host: {value!r}")
    try:
        port = parts.port or 80
    except ValueError:
        raise _Invalid(f"bad port in {value!r}") from None
    return Upstream(parts.hostname, port)


def _upstreams(value: object) -> tuple[Upstream, ...]:
    """One URL, or a list of URLs (the route's endpoints, tried in turn and in parallel)."""
    if isinstance(value, list):
        if not value:
            raise _Invalid("expected at least one upstream URL")
        if len(value) > MAX_UPSTREAMS:
            raise _Invalid(f"at most {MAX_UPSTREAMS} upstream URLs, got {len(value)}")
        out: list[Upstream] = []
        for i, item in enumerate(value):
            try:
                u = _upstream(item)
            except _Invalid as exc:
                raise _Invalid(f"item {i}: {exc}") from None
            if u in out:
                raise _Invalid(f"item {i}: {u} is listed twice")
            out.append(u)
        return tuple(out)
    return (_upstream(value),)


def _only_one_worker(value: object) -> int:
    if value != 1 or isinstance(value, bool):
        raise _Invalid(
            "only 1 is supported: a sidecar is one process (breaker, budget, kill switch and "
            "DLQ are per process); run more replicas to use more cores"
        )
    return 1


def _url_path(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise _Invalid(f"expected a path starting with '/', got {value!r}")
    return value


HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token


def _header_names(value: object) -> frozenset[str]:
    if not isinstance(value, list):
        raise _Invalid(f"expected a list of header names, got {_kind(value)}")
    names = set()
    for item in value:
        if not isinstance(item, str) or not HEADER_NAME.match(item):
            raise _Invalid(f"{item!r} is not a header name")
        names.add(item.lower())
    return frozenset(names)


def _regex(value: object) -> PathPattern:
    """RE2, as Envoy's safe_regex: matching time is linear in the path. Python's re
    backtracks: ``/(a+)+b`` against 40 a's, a path any client may send, froze the event loop
    for hours. RE2 has no lookaround or backreferences; a pattern using them is refused here.
    Imported only when a route has a path_regex."""
    if not isinstance(value, str):
        raise _Invalid(f"expected a regular expression string, got {value!r}")
    import re2  # type: ignore[import-untyped]

    options = re2.Options()
    options.log_errors = False  # the error is reported here, not on stderr by RE2
    try:
        compiled: PathPattern = re2.compile(value, options)
    except re2.error as exc:
        why = exc.args[0] if exc.args else exc
        why = why.decode("utf-8", "replace") if isinstance(why, bytes) else str(why)
        raise _Invalid(f"invalid regular expression (RE2 syntax): {why}") from None
    return compiled


def _methods(value: object) -> frozenset[str]:
    if not isinstance(value, list) or not value:
        raise _Invalid("expected a non-empty list of HTTP methods")
    out = set()
    for m in value:
        if not isinstance(m, str) or m.upper() not in HTTP_METHODS:
            raise _Invalid(f"unknown HTTP method {m!r}")
        out.add(m.upper())
    return frozenset(out)


def _hedge_methods(value: object) -> frozenset[str]:
    """Idempotent methods only: a hedge is a second copy of a request still in flight."""
    methods = _methods(value)
    for m in sorted(methods - IDEMPOTENT_METHODS):
        raise _Invalid(f"{m} is not idempotent: a hedge would send it twice")
    return methods


def _retry_on(value: object) -> RetryOn:
    """The words of ``sidecar.outcomes`` (each one failure kind, or a group of statuses) and
    status codes."""
    words = ", ".join(outcomes.RETRY_ON_WORDS)
    if not isinstance(value, list):
        raise _Invalid(f"expected a list like [{words}, 503]")
    kinds: set[OutcomeKind] = set()
    statuses: set[int] = set()
    for item in value:
        if isinstance(item, bool):
            raise _Invalid(f"unknown retry condition {item!r}")
        if isinstance(item, int) or (isinstance(item, str) and item.isdigit()):
            code = int(item)
            if not 400 <= code <= 599:
                # A 1xx/2xx/3xx is the upstream answering: "retrying" it would resend a
                # request that was already handled (a write done twice).
                raise _Invalid(f"only 4xx and 5xx statuses can be retried, not {item!r}")
            statuses.add(code)
        elif isinstance(item, str) and item in outcomes.STATUS_GROUPS:
            statuses.update(outcomes.STATUS_GROUPS[item])
        elif isinstance(item, str) and item in outcomes.RETRY_ON_WORDS:
            kinds.add(outcomes.RETRY_ON_WORDS[item])
        else:
            groups = " or ".join(outcomes.STATUS_GROUPS)
            raise _Invalid(
                f"unknown retry condition {item!r} (use {words}, a status code, {groups})"
            )
    return RetryOn(kinds=frozenset(kinds), statuses=frozenset(statuses))


# -- entry points -------------------------------------------------------------------------------


def parse_text(text: str, source: str = "<memory>") -> Config:
    """Parse and validate; raise ConfigError listing every problem found."""
    sha = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    try:
        located = load(text)
    except YamlLoadError as exc:
        raise ConfigError(source, [ConfigIssue(exc.line, exc.path, exc.message)]) from None
    parser = _Parser(located)
    config = parser.config(source, sha)
    if config is None:
        raise ConfigError(source, parser.issues)
    return config


def read_file(path: str) -> bytes:
    """The config file's bytes, at most one more than the document limit: a regular file only.

    Opened non-blocking, so that a FIFO put where the file was (which open() would wait on
    for a writer forever, holding the reload lock and a thread) or a device (/dev/zero,
    read forever) is refused at once; a larger file is not read past the limit."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a directory, FIFO, socket or device)")
        return f.read(MAX_DOCUMENT_BYTES + 1)


def parse_file(path: str) -> Config:
    try:
        raw = read_file(path)
    except OSError as exc:
        raise ConfigError(
            path, [ConfigIssue(0, "<file>", f"cannot read: {exc.strerror}")]
        ) from None
    return parse_bytes(raw, path)


def parse_bytes(raw: bytes, path: str) -> Config:
    """The file's bytes as read once: the version (sha256) is of exactly these bytes."""
    if len(raw) > MAX_DOCUMENT_BYTES:  # checked before decoding: the read stops past it
        raise ConfigError(
            path, [ConfigIssue(1, "<file>", f"the file is larger than {MAX_DOCUMENT_BYTES} bytes")]
        )
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(path, [ConfigIssue(1, "<file>", "the file is not UTF-8")]) from None
    return parse_text(text, source=path)

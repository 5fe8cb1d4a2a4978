"""The checks of config values: each takes the raw YAML value and returns the typed one or
raises ``Invalid`` (or ``units.UnitError``) with the message the error shows. The schema names
one for every key (``sidecar/config/schema.py``)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from sidecar import outcomes
from sidecar.config import units
from sidecar.config.values import (
    IDEMPOTENT_METHODS,
    IpNetwork,
    Listen,
    PathPattern,
    RetryOn,
    Upstream,
)
from sidecar.outcomes import OutcomeKind

HTTP_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "TRACE", "CONNECT"}
)
ROUTE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
MAX_UPSTREAMS = 64


class Invalid(Exception):
    """Raised inside a check; turned into a ConfigIssue (with line and key path) by the parser."""


def kind(value: object) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean"}.get(
        type(value), type(value).__name__
    )


def boolean(value: object) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"expected true or false, got {value!r}")
    return value


def int_range(lo: int, hi: int) -> Callable[[object], int]:
    def check(value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid(f"expected a whole number from {lo} to {hi}, got {value!r}")
        if not lo <= value <= hi:
            raise Invalid(f"must be from {lo} to {hi}, got {value}")
        return value

    return check


# No ratio, rate, multiplier or factor of the config needs more; a bigger one overflowed
# arithmetic (a budget's min_per_second of 1e308 times its window is inf).
MAX_NUMBER = 1e9


def number(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Invalid(f"expected a number, got {value!r}")
    if isinstance(value, int) and abs(value) > MAX_NUMBER:  # before float(), which overflows
        raise Invalid(f"must be at most {MAX_NUMBER:g}, got {value!r}")
    f = float(value)
    if f != f or f in (float("inf"), float("-inf")):
        raise Invalid(f"expected a finite number, got {value!r}")
    if abs(f) > MAX_NUMBER:
        raise Invalid(f"must be at most {MAX_NUMBER:g}, got {value!r}")
    return f


def non_negative_number(value: object) -> float:
    f = number(value)
    if f < 0:
        raise Invalid(f"must not be negative, got {value}")
    return f


def positive_number(value: object) -> float:
    f = number(value)
    if f <= 0:
        raise Invalid(f"must be greater than 0, got {value}")
    return f


def ratio(value: object) -> float:
    f = number(value)
    if not 0 < f <= 1:
        raise Invalid(f"must be greater than 0 and at most 1, got {value}")
    return f


def duration(value: object) -> float:
    return units.parse_duration(value)


def auto_or_duration(value: object) -> float | None:
    """``auto`` (None: the adaptive per-try timeout) or a positive duration."""
    if value == "auto":
        return None
    try:
        return positive_duration(value)
    except units.UnitError as exc:
        raise Invalid(f"{exc} (or auto)") from None


def percentile(value: object) -> float:
    f = number(value)
    if not 0 < f < 1:
        raise Invalid(f"must be between 0 and 1 (0.95 is the 95th percentile), got {value}")
    return f


def at_least(lo: float) -> Callable[[object], float]:
    def check(value: object) -> float:
        f = number(value)
        if f < lo:
            raise Invalid(f"must be at least {lo:g}, got {value}")
        return f

    return check


def positive_duration(value: object) -> float:
    d = units.parse_duration(value)
    if d <= 0:
        raise Invalid(f"must be greater than 0, got {value!r}")
    return d


class Choice:
    """One of ``options`` (the words a key takes, which the schema's readers may list)."""

    __slots__ = ("options",)

    def __init__(self, options: tuple[str, ...]) -> None:
        self.options = options

    def __call__(self, value: object) -> Any:
        if value not in self.options:
            raise Invalid(f"must be one of {', '.join(self.options)}; got {value!r}")
        assert isinstance(value, str)
        return value


def non_empty_str(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise Invalid(f"expected a non-empty string, got {value!r}")
    return value


def name(value: object) -> str:
    s = non_empty_str(value)
    if not all(33 <= ord(c) < 127 for c in s) or len(s) > 128:
        raise Invalid("must be 1-128 visible ASCII characters (it is sent in a header)")
    return s


def route_name(value: object) -> str:
    if not isinstance(value, str) or not ROUTE_NAME.match(value):
        raise Invalid(
            "must be 1-63 characters of letters, digits, '_', '.', '-', starting with a letter "
            f"or digit (it is a metric label); got {value!r}"
        )
    return value


def env_name(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", value):
        raise Invalid(f"expected an environment variable name, got {value!r}")
    return value


def listen(value: object) -> Listen:
    if not isinstance(value, str):
        raise Invalid(f"expected 'host:port', got {value!r}")
    host, sep, port_s = value.rpartition(":")
    if not sep or not host or not port_s.isdigit():
        raise Invalid(f"expected 'host:port' like '0.0.0.0:15001', got {value!r}")
    host = host.strip("[]")
    try:
        ipaddress.ip_address(host)
    except ValueError:
        if host != "localhost":
            raise Invalid(f"the host must be an IP address or 'localhost', got {host!r}") from None
    port = int(port_s)
    if port > 65535:
        raise Invalid(f"port must be at most 65535, got {port}")
    return Listen(host, port)


HOST_NAME = re.compile(
    r"^(?=.{1,253}$)[a-z0-9_]([a-z0-9_-]{0,62})(\.[a-z0-9_]([a-z0-9_-]{0,62}))*$"
)


def host_names(value: object) -> tuple[str, ...]:
    """``admin.allowed_hosts``: DNS names or IP addresses, as a Host header names them (without
    the port); compared without regard to case."""
    if not isinstance(value, list):
        raise Invalid("expected a list of host names like 'retry-sidecar-admin.shop.svc'")
    out = []
    for item in value:
        name = str(item).lower().rstrip(".") if isinstance(item, str) else ""
        try:
            out.append(str(ipaddress.ip_address(name.strip("[]"))))
            continue
        except ValueError:
            pass
        if not HOST_NAME.match(name):
            raise Invalid(
                f"not a host name or IP address (no port, no scheme, no wildcard): {item!r}"
            )
        out.append(name)
    return tuple(out)


def networks(value: object) -> tuple[IpNetwork, ...]:
    if not isinstance(value, list):
        raise Invalid("expected a list of CIDR ranges like '127.0.0.0/8'")
    out = []
    for item in value:
        try:
            out.append(ipaddress.ip_network(str(item), strict=False))
        except ValueError:
            raise Invalid(f"not a CIDR range: {item!r}") from None
    return tuple(out)


def upstream(value: object) -> Upstream:
    if not isinstance(value, str):
        raise Invalid(f"expected a URL like 'http://127.0.0.1:8080', got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise Invalid(f"expected an http:// or https:// URL, got {value!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username:
        raise Invalid(f"the upstream URL must be scheme://host:port only, got {value!r}")
    if not parts.hostname:
        raise Invalid(f"the upstream URL has no host: {value!r}")
    try:
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
    except ValueError:
        raise Invalid(f"bad port in {value!r}") from None
    return Upstream(parts.hostname, port, tls)


def upstreams(value: object) -> tuple[Upstream, ...]:
    """One URL, or a list of URLs (the route's endpoints, tried in turn and in parallel)."""
    if isinstance(value, list):
        if not value:
            raise Invalid("expected at least one upstream URL")
        if len(value) > MAX_UPSTREAMS:
            raise Invalid(f"at most {MAX_UPSTREAMS} upstream URLs, got {len(value)}")
        out: list[Upstream] = []
        for i, item in enumerate(value):
            try:
                u = upstream(item)
            except Invalid as exc:
                raise Invalid(f"item {i}: {exc}") from None
            if u in out:
                raise Invalid(f"item {i}: {u} is listed twice")
            out.append(u)
        return tuple(out)
    return (upstream(value),)


def only_one_worker(value: object) -> int:
    if value != 1 or isinstance(value, bool):
        raise Invalid(
            "only 1 is supported: a sidecar is one process (breaker, budget, kill switch and "
            "DLQ are per process); run more replicas to use more cores"
        )
    return 1


def url_path(value: object) -> str:
    if not isinstance(value, str) or not value.startswith("/"):
        raise Invalid(f"expected a path starting with '/', got {value!r}")
    return value


HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # RFC 9110 token


def header_names(value: object) -> frozenset[str]:
    if not isinstance(value, list):
        raise Invalid(f"expected a list of header names, got {kind(value)}")
    names = set()
    for item in value:
        if not isinstance(item, str) or not HEADER_NAME.match(item):
            raise Invalid(f"{item!r} is not a header name")
        names.add(item.lower())
    return frozenset(names)


def regex(value: object) -> PathPattern:
    """RE2, as Envoy's safe_regex: matching time is linear in the path. Python's re
    backtracks: ``/(a+)+b`` against 40 a's, a path any client may send, froze the event loop
    for hours. RE2 has no lookaround or backreferences; a pattern using them is refused here.
    Imported only when a route has a path_regex."""
    if not isinstance(value, str):
        raise Invalid(f"expected a regular expression string, got {value!r}")
    import re2  # type: ignore[import-untyped]

    options = re2.Options()
    options.log_errors = False  # the error is reported here, not on stderr by RE2
    try:
        compiled: PathPattern = re2.compile(value, options)
    except re2.error as exc:
        why = exc.args[0] if exc.args else exc
        why = why.decode("utf-8", "replace") if isinstance(why, bytes) else str(why)
        raise Invalid(f"invalid regular expression (RE2 syntax): {why}") from None
    return compiled


def methods(value: object) -> frozenset[str]:
    if not isinstance(value, list) or not value:
        raise Invalid("expected a non-empty list of HTTP methods")
    out = set()
    for m in value:
        if isinstance(m, str) and m not in HTTP_METHODS and m.upper() in HTTP_METHODS:
            # RFC 9110 section 9.1: the method token is case-sensitive; "get" is another
            # method than GET (one no client sends), so the entry would be dead or a guess.
            raise Invalid(
                f"methods are case-sensitive (RFC 9110 section 9.1): {m!r} is not "
                f"{m.upper()}; write {m.upper()}"
            )
        if not isinstance(m, str) or m not in HTTP_METHODS:
            raise Invalid(f"unknown HTTP method {m!r}")
        out.add(m)
    return frozenset(out)


def hedge_methods(value: object) -> frozenset[str]:
    """Idempotent methods only: a hedge is a second copy of a request still in flight. POST
    may be listed for gRPC calls (gRFC A6's hedging, opt-in): a plain POST is never hedged."""
    listed = methods(value)
    for m in sorted(listed - IDEMPOTENT_METHODS - {"POST"}):
        raise Invalid(f"{m} is not idempotent: a hedge would send it twice")
    return listed


def _retry_on(value: object) -> RetryOn:
    """The words of ``sidecar.outcomes`` (each one failure kind, or a group of statuses) and
    status codes."""
    words = ", ".join(outcomes.RETRY_ON_WORDS)
    if not isinstance(value, list):
        raise Invalid(f"expected a list like [{words}, 503]")
    kinds: set[OutcomeKind] = set()
    statuses: set[int] = set()
    grpc: set[int] = set()
    for item in value:
        if isinstance(item, bool):
            raise Invalid(f"unknown retry condition {item!r}")
        if isinstance(item, int) or (isinstance(item, str) and item.isdigit()):
            code = int(item)
            if not 400 <= code <= 599:
                # A 1xx/2xx/3xx is the upstream answering: "retrying" it would resend a
                # request that was already handled (a write done twice).
                raise Invalid(f"only 4xx and 5xx statuses can be retried, not {item!r}")
            statuses.add(code)
        elif isinstance(item, str) and item in outcomes.STATUS_GROUPS:
            statuses.update(outcomes.STATUS_GROUPS[item])
        elif isinstance(item, str) and item in outcomes.RETRY_ON_WORDS:
            kinds.add(outcomes.RETRY_ON_WORDS[item])
        elif isinstance(item, str) and item in outcomes.GRPC_RETRY_ON:
            grpc.add(outcomes.GRPC_RETRY_ON[item])
        else:
            groups = " or ".join(outcomes.STATUS_GROUPS)
            codes = ", ".join(outcomes.GRPC_RETRY_ON)
            raise Invalid(
                f"unknown retry condition {item!r} (use {words}, a status code, {groups}, "
                f"or a gRPC status: {codes})"
            )
    return RetryOn(kinds=frozenset(kinds), statuses=frozenset(statuses), grpc=frozenset(grpc))


def retry_on_written(value: RetryOn) -> list[str | int]:
    """``retry_on`` as a config writes it (the inverse of ``_retry_on``), words in the table's
    order."""
    words: list[str | int] = [w for w, k in outcomes.RETRY_ON_WORDS.items() if k in value.kinds]
    grpc = [w for w, code in outcomes.GRPC_RETRY_ON.items() if code in value.grpc]
    return words + sorted(value.statuses) + grpc


def size(value: object) -> int:
    return units.parse_size(value)


def size_or_unlimited(value: object) -> int:
    return units.parse_size_or_unlimited(value)


def per_try_beyond_timeout(per_try: float | None, timeout: float) -> str | None:
    """Why a fixed ``retry.per_try_timeout`` longer than the route's ``timeout`` is surprising
    (valid, but it never applies: the deadline cuts every attempt first), with the fix; None
    when it is not. Pure."""
    if per_try is None or per_try <= timeout:
        return None
    return (
        f"per_try_timeout {per_try:g}s is longer than the route's timeout {timeout:g}s, so it "
        "never applies: the deadline ends every attempt first (and no retry follows); write a "
        f"per_try_timeout below {timeout:g}s (or auto), or raise timeout"
    )

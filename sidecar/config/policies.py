"""The per-route policies: one frozen dataclass per section of a route (and of ``defaults``).
Each field is a key of the schema: its default, its check and what the docs say of it are
written here once (``sidecar/config/schema.py``)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Literal

from sidecar.config import checks as c
from sidecar.config.schema import key, rule, section
from sidecar.config.values import HEDGE_METHODS, RetryOn

BackoffStrategy = Literal[
    "full_jitter", "equal_jitter", "decorrelated_jitter", "exponential", "constant"
]
NonIdempotent = Literal["never", "with-idempotency-key", "always"]
DlqRespond = Literal["passthrough", "accepted"]

BACKOFF_STRATEGIES: tuple[BackoffStrategy, ...] = (
    "full_jitter",
    "equal_jitter",
    "decorrelated_jitter",
    "exponential",
    "constant",
)
NON_IDEMPOTENT: tuple[NonIdempotent, ...] = ("never", "with-idempotency-key", "always")
DLQ_RESPOND: tuple[DlqRespond, ...] = ("passthrough", "accepted")
MAX_ATTEMPTS = 10
Problems = list[tuple[str, str]]


@dataclass(frozen=True, slots=True)
class Backoff:
    strategy: BackoffStrategy = key("full_jitter", c.Choice(BACKOFF_STRATEGIES))
    base: float = key(0.025, c.duration, unit="duration")
    max: float = key(0.25, c.duration, unit="duration")


@rule(Backoff)
def _backoff_max(b: Backoff, written: Collection[str]) -> tuple[Backoff, Problems]:
    return b, [("max", f"must be at least base ({b.base}s)")] if b.max < b.base else []


@dataclass(frozen=True, slots=True)
class RetryAfter:
    honor: bool = key(True, c.boolean)
    max: float = key(30.0, c.positive_duration, unit="duration")


@dataclass(frozen=True, slots=True)
class AutoTimeout:
    """``retry.per_try_timeout: auto``: ``multiplier`` x the ``percentile`` of the route's
    recent attempt latencies, clamped to [min, max]. When it expires, an attempt that may be
    hedged is raced by a new one (never abandoned); any other attempt waits for the deadline."""

    percentile: float = key(0.95, c.percentile)
    multiplier: float = key(2.0, c.at_least(1.0))
    min: float = key(0.05, c.positive_duration, unit="duration")
    max: float = key(10.0, c.positive_duration, unit="duration")


@rule(AutoTimeout)
def _auto_max(a: AutoTimeout, written: Collection[str]) -> tuple[AutoTimeout, Problems]:
    return a, [("max", f"must be at least min ({a.min}s)")] if a.max < a.min else []


def _auto_written(value: float | None) -> object:
    return "auto" if value is None else value


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = key(
        3,
        c.int_range(1, MAX_ATTEMPTS),
        note="total tries including the first (hedges included)",
        help=(
            "total tries including the first (1 to 10), hedges included; 1 = no retries. The "
            'budget and the throttle may allow fewer (see "Storm control": at 100 req/s the '
            "budget allows 0.6 retries per request on average, where nginx's 3 tries allow 2)"
        ),
    )
    # None is ``auto`` (see AutoTimeout); a number is a fixed per-try timeout: the attempt is
    # abandoned when it expires and counts as a per-try-timeout failure.
    per_try_timeout: float | None = key(
        None,
        c.auto_or_duration,
        unit="duration",
        show=_auto_written,
        note="or a duration (the attempt is abandoned then and retried)",
        help=(
            "`auto` (as Envoy's per-try timeout, which defaults to the route's): an attempt is "
            "never abandoned for being slow -- it waits for the deadline, unless the route "
            "turns hedging on (`hedge.enabled`) and the request is of a method it hedges: "
            "then, still unanswered after the adaptive timeout below, it is *hedged* (raced by "
            'another attempt, see "Storm control"). A duration: each attempt may take that '
            "long to connect and receive the response head (clipped by the deadline), then it "
            "is abandoned and counts as `per-try-timeout` (a streamed upload: the head wait "
            "starts when the body is sent, and the upstream must keep taking body bytes "
            "within it)"
        ),
    )
    auto_timeout: AutoTimeout = section(
        AutoTimeout,
        flow=True,
        help=(
            "the adaptive per-try timeout: `multiplier` x the `percentile` of the route's "
            "attempt latencies of the last 10 s, clamped to [`min`, `max`]; `max` until 20 "
            "attempts have been seen. An attempt cancelled after running at least the timeout "
            "in force (a hedged original that lost) counts as the time it ran (a censored "
            "sample: it took at least that long), so the estimate does not learn only from "
            "winners"
        ),
    )
    backoff: Backoff = section(
        Backoff,
        flow=True,
        help=(
            "`full_jitter`, `equal_jitter`, `decorrelated_jitter`, `exponential`, `constant`; "
            "every delay lies in [0, max] for any attempt number"
        ),
    )
    retry_on: RetryOn = key(
        RetryOn(),
        c._retry_on,
        show=c.retry_on_written,
        help=(
            "also any status code, `5xx`, `gateway-error` (502, 503, 504), `429`; for a gRPC "
            "call, the gRPC statuses `cancelled`, `deadline-exceeded`, `internal`, "
            "`resource-exhausted`, `unavailable` (as Envoy's retry-grpc-on; the default has "
            '`unavailable`), read from the trailers or a Trailers-Only answer; see "gRPC"'
        ),
    )
    retry_after: RetryAfter = section(
        RetryAfter,
        flow=True,
        help=(
            "on 429/503, wait what `Retry-After` says (seconds, or an HTTP-date in any of RFC "
            "9110's three forms: IMF-fixdate, RFC 850, asctime), capped at `max`, plus up to "
            "10% jitter; if that would pass the deadline, stop now (`retry-after-too-long`)"
        ),
    )
    non_idempotent: NonIdempotent = key(
        "with-idempotency-key",
        c.Choice(NON_IDEMPOTENT),
        help=(
            "POST/PATCH are resent: `never`, only `with-idempotency-key` (the header is sent "
            "unchanged on every attempt; an empty or blank `Idempotency-Key:` is no key, nor "
            "is one the client names in `Connection`, which makes it hop-by-hop: it is "
            "dropped), or `always`"
        ),
    )
    max_body_bytes: int = key(
        64 * 1024,
        c.size,
        unit="size",
        help=(
            "request bodies up to this are buffered so they can be resent; larger ones are "
            "streamed once and never resent"
        ),
    )


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    enabled: bool = key(True, c.boolean)
    # "Down", not "degraded": a 60% partial failure is the throttle's business, and a breaker
    # that opens on it turns a 60% failure into a 100% one.
    failure_ratio: float = key(0.95, c.ratio)
    min_sequences: int = key(20, c.int_range(1, 1_000_000))
    window: float = key(10.0, c.positive_duration, unit="duration")
    open_for: float = key(
        1.0, c.positive_duration, unit="duration", note="doubled on each reopen..."
    )
    max_open_for: float = key(30.0, c.positive_duration, unit="duration", note="...up to this")
    half_open_probes: int = key(
        3, c.int_range(1, 1000), note="judged during the half-open ramp before it decides"
    )
    ramp: float = key(
        1.0,
        c.duration,
        unit="duration",
        note="half-open admits a share of traffic growing to all over this",
    )


@rule(BreakerPolicy)
def _breaker_open_for(b: BreakerPolicy, written: Collection[str]) -> tuple[BreakerPolicy, Problems]:
    problems: Problems = []
    if "max_open_for" in written and b.max_open_for < b.open_for:
        problems.append(("max_open_for", f"must be at least open_for ({b.open_for:g}s)"))
    # An open_for written above an inherited max_open_for: it does not grow, then.
    return replace(b, max_open_for=max(b.max_open_for, b.open_for)), problems


@dataclass(frozen=True, slots=True)
class BudgetPolicy:
    ratio: float = key(0.5, c.non_negative_number)
    min_per_second: float = key(10.0, c.non_negative_number)
    window: float = key(10.0, c.positive_duration, unit="duration")


@dataclass(frozen=True, slots=True)
class BulkheadPolicy:
    max_concurrent: int = key(1000, c.int_range(1, 1_000_000))
    queue_timeout: float = key(1.0, c.duration, unit="duration")
    # The adaptive concurrency limit: upstream attempts in flight follow latency between
    # min_concurrent and max_concurrent (a gradient limit, as Envoy's adaptive-concurrency).
    # Opt-in, as Envoy's filter is: it reads long-polls and slow handlers as overload and
    # refuses requests that the app, asked directly, would answer.
    adaptive: bool = key(False, c.boolean)
    min_concurrent: int = key(5, c.int_range(1, 1_000_000))


@rule(BulkheadPolicy)
def _bulkhead_min(b: BulkheadPolicy, written: Collection[str]) -> tuple[BulkheadPolicy, Problems]:
    problems: Problems = []
    if "min_concurrent" in written and b.min_concurrent > b.max_concurrent:
        problems.append(("min_concurrent", f"must not exceed max_concurrent ({b.max_concurrent})"))
    # An inherited minimum above a smaller max_concurrent written here is clamped to it.
    return replace(b, min_concurrent=min(b.min_concurrent, b.max_concurrent)), problems


@dataclass(frozen=True, slots=True)
class ThrottlePolicy:
    """Adaptive throttling (Google SRE book, "Handling Overload") of the attempts the sidecar
    adds (retries and hedges): refused with probability
    max(0, (requests - k * accepts) / (requests + 1)) over ``window``."""

    enabled: bool = key(True, c.boolean)
    k: float = key(2.0, c.at_least(1.0))
    # short: an outage is seen within half a second, not a minute
    window: float = key(1.0, c.positive_duration, unit="duration")
    min_requests: int = key(10, c.int_range(0, 1_000_000))


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

    enabled: bool = key(False, c.boolean)
    methods: frozenset[str] = key(
        HEDGE_METHODS,
        c.hedge_methods,
        help=(
            "the methods hedged: idempotent ones, and `POST` for gRPC calls only (gRPC's "
            "hedging, opt-in: the service owner says its calls are safe to run twice); a plain "
            "HTTP POST is never hedged"
        ),
    )
    ratio: float = key(0.1, c.non_negative_number)
    min_per_second: float = key(1.0, c.non_negative_number)
    window: float = key(10.0, c.positive_duration, unit="duration")


@dataclass(frozen=True, slots=True)
class UpgradePolicy:
    """HTTP Upgrade (WebSocket and others): passed through as a tunnel when enabled (the
    upstream's 101 relayed, then bytes both ways), cut after ``idle_timeout`` without a byte
    either way. Disabled, an upgrade request is an ordinary request without its ``Upgrade``,
    as nginx sends it without upgrade configuration."""

    enabled: bool = key(True, c.boolean)
    # Envoy's TCP proxy idle timeout
    idle_timeout: float = key(3600.0, c.positive_duration, unit="duration")


@dataclass(frozen=True, slots=True)
class RedrivePolicy:
    enabled: bool = key(False, c.boolean)
    interval: float = key(30.0, c.positive_duration, unit="duration")


@dataclass(frozen=True, slots=True)
class RouteDlq:
    enabled: bool = key(False, c.boolean)
    respond: DlqRespond = key("passthrough", c.Choice(DLQ_RESPOND))
    keep_credentials: bool = key(False, c.boolean)
    max_replays: int = key(5, c.int_range(1, 1000))
    replay_rate: float = key(50.0, c.positive_number)
    redrive: RedrivePolicy = section(RedrivePolicy, flow=True)
    # Lower-case header names never stored with a record (beyond the credentials, which
    # keep_credentials governs).
    drop_headers: frozenset[str] = key(
        frozenset(),
        c.header_names,
        note="header names never stored, beyond the credentials",
    )

"""The shared vocabulary every layer may import: fates, outcome kinds, the breaker's verdicts,
the clock and the error types. It imports nothing from the project, so no layer has to reach
"up" (the upstream client into the retry rules, the DLQ into the proxy) to name these.
See docs/architecture.md for the layering.
"""

from __future__ import annotations

import socket
import time
from enum import Enum, StrEnum
from typing import ClassVar

from mypy_extensions import mypyc_attr


class Fate(StrEnum):
    """Why a sequence stopped (the ``x-retry-fate`` header)."""

    SUCCESS = "success"
    EXHAUSTED = "exhausted"
    NOT_RETRYABLE = "not-retryable"
    NON_IDEMPOTENT = "non-idempotent"
    BODY_TOO_LARGE = "body-too-large"
    BUDGET_EXHAUSTED = "budget-exhausted"
    THROTTLED = "throttled"  # the adaptive throttle refused a wanted retry
    BREAKER_OPEN = "breaker-open"
    KILL_SWITCH = "kill-switch"
    DEADLINE = "deadline"
    EDGE_OWNED = "edge-owned"
    RETRY_AFTER_TOO_LONG = "retry-after-too-long"
    OVERLOADED = "overloaded"  # bulkhead or connection pool full: the upstream was not asked
    DRAINING = "draining"  # the sidecar is shutting down and made no further retry
    CLIENT_GONE = "client-gone"  # the client left; the sequence was cancelled for nobody


class OutcomeKind(Enum):
    RESPONSE = "response"
    CONNECT_FAILURE = "connect-failure"
    RESET = "reset"
    PER_TRY_TIMEOUT = "per-try-timeout"
    # An answer that cannot be relayed as HTTP (bad status, transfer coding, head size): a
    # property of the response, never retried.
    BAD_RESPONSE = "bad-response"


class Verdict(Enum):
    """The one thing a finished sequence tells its route's circuit breaker."""

    SUCCESS = "success"  # the upstream answered as intended
    FAILURE = "failure"  # evidence the upstream is failing
    NEUTRAL = "neutral"  # says nothing about the upstream: it was never reached, the client
    # left, or the sequence was cut short locally; a half-open probe slot is handed back


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it (FakeClock)
class Clock:
    """Monotonic time for deadlines and wall time for Retry-After dates and records."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class UpstreamError(Exception):
    """An attempt failed on the wire. Raised by the upstream client, judged by the retry rules."""

    # Class-level facts of each error type (ClassVar: compiled with mypyc they stay class
    # attributes, overridden by the subclasses below).
    kind: ClassVar[OutcomeKind] = OutcomeKind.RESET
    code: ClassVar[str] = "upstream-reset"  # the x-retry-proxy-error value when the sidecar answers
    status: ClassVar[int] = 502
    reached_upstream: ClassVar[bool] = True  # may bytes of the request have reached the upstream?
    # The RFC 9209 Proxy-Status error type of an answer the sidecar makes from this class of
    # error; ``error_type`` is the one of this error (a connect failure knows "refused").
    proxy_status: ClassVar[str] = "connection_terminated"

    def __init__(self, message: str = "", error_type: str | None = None) -> None:
        super().__init__(message)
        self.error_type: str = error_type if error_type is not None else self.proxy_status


class ConnectFailure(UpstreamError):
    """No byte of the request left this process: the connection could not be made."""

    kind = OutcomeKind.CONNECT_FAILURE
    code = "connect-failure"
    reached_upstream = False
    proxy_status = "destination_unavailable"


def connect_error_type(exc: OSError) -> str:
    """The RFC 9209 error type of a failed connect."""
    if isinstance(exc, socket.gaierror):
        return "dns_error"
    if isinstance(exc, ConnectionRefusedError):
        return "connection_refused"
    return "destination_unavailable"


class UpstreamReset(UpstreamError):
    """The connection broke, or the upstream spoke something other than HTTP/1.x."""

    kind = OutcomeKind.RESET
    code = "upstream-reset"


class AttemptTimeout(UpstreamError):
    """No complete response head within the per-try timeout."""

    kind = OutcomeKind.PER_TRY_TIMEOUT
    code = "per-try-timeout"
    status = 504
    proxy_status = "http_response_timeout"


class RetryStopped(UpstreamError):
    """A retry was due but the kill switch was set during its backoff: the sequence ends with
    the last attempt's failure, whose response was already let go. Nothing broke on the wire:
    the upstream answered (``received_status``, RFC 9209's ``received-status``) with a failure
    the policy retries, so the next hop counts as unavailable for now."""

    code = "kill-switch"
    status = 503
    proxy_status = "destination_unavailable"

    def __init__(self, message: str = "", received_status: int | None = None) -> None:
        super().__init__(message)
        self.received_status = received_status


class NoTimeLeft(AttemptTimeout):
    """The sequence deadline was spent before this attempt could write a byte upstream."""

    code = "deadline"
    reached_upstream = False


class BadResponse(UpstreamError):
    """The upstream answered with something no client should get: a status outside 100-599,
    a transfer coding other than chunked, a head over the size limits. A property of the
    response, not a transient fault: never retried (nginx's default proxy_next_upstream does
    not retry ``invalid_header`` either)."""

    kind = OutcomeKind.BAD_RESPONSE
    code = "bad-response"
    proxy_status = "http_protocol_error"


class BodyTimeout(UpstreamError):
    """The upstream sent no body bytes for the stream idle timeout (after the head)."""

    code = "stream-idle-timeout"
    proxy_status = "http_response_timeout"


class LocalOverload(Exception):
    """The sidecar itself has no room for the attempt; the upstream was not asked."""

    code: ClassVar[str] = "overloaded"
    status: ClassVar[int] = 503
    reached_upstream: ClassVar[bool] = False
    proxy_status: ClassVar[str] = "connection_limit_reached"


class PoolExhausted(LocalOverload):
    """Every pooled connection to the upstream stayed busy for the whole pool wait."""

    code = "pool-exhausted"


class Overloaded(LocalOverload):
    """The route's bulkhead stayed full for its whole queue timeout."""

    code = "overloaded"


class ConcurrencyLimited(LocalOverload):
    """The route's adaptive concurrency limit is reached: latency says the upstream is queueing."""

    code = "concurrency-limit"

"""The shared vocabulary every layer may import: fates, the breaker's verdicts, the clock and
the error types, each error naming its row of the outcome table (``sidecar.outcomes``). It
imports nothing else from the project, so no layer has to reach "up" (the upstream client into
the retry rules, the DLQ into the proxy) to name these. See docs/architecture.md for the
layering.
"""

from __future__ import annotations

import socket
import time
from enum import Enum, StrEnum
from typing import ClassVar

from mypy_extensions import mypyc_attr

from sidecar import outcomes
from sidecar.outcomes import OutcomeKind, OutcomeRow


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
    # attributes, overridden by the subclasses below). ``answer``: its row of the outcome
    # table, which says its code, the sidecar's status and Proxy-Status error, and what it
    # means for the breaker, the throttle, the concurrency limit and the endpoint.
    answer: ClassVar[OutcomeRow] = outcomes.RESET
    kind: ClassVar[OutcomeKind] = OutcomeKind.RESET
    reached_upstream: ClassVar[bool] = True  # may bytes of the request have reached the upstream?

    def __init__(self, message: str = "", error_type: str | None = None) -> None:
        super().__init__(message)
        # The RFC 9209 error type of this error (a connect failure knows "refused").
        self.error_type: str | None = error_type
        # A gRPC call's failure as gRPC reads it (a reset stream is CANCELLED or INTERNAL, a
        # connection lost UNAVAILABLE): judged by ``retry_on``'s gRPC statuses; -1: none.
        self.grpc = -1

    @property
    def code(self) -> str:
        return self.answer.code


class ConnectFailure(UpstreamError):
    """No byte of the request left this process: the connection could not be made."""

    answer = outcomes.CONNECT_FAILURE
    kind = OutcomeKind.CONNECT_FAILURE
    reached_upstream = False


def connect_error_type(exc: OSError) -> str:
    """The RFC 9209 error type of a failed connect."""
    if isinstance(exc, socket.gaierror):
        return "dns_error"
    if isinstance(exc, ConnectionRefusedError):
        return "connection_refused"
    return "destination_unavailable"


class UpstreamReset(UpstreamError):
    """The connection broke, or the upstream spoke something other than HTTP/1.x."""


class AttemptTimeout(UpstreamError):
    """No complete response head within the per-try timeout."""

    answer = outcomes.PER_TRY_TIMEOUT
    kind = OutcomeKind.PER_TRY_TIMEOUT


class RetryStopped(UpstreamError):
    """A retry was due but the kill switch was set during its backoff: the sequence ends with
    the last attempt's failure, whose response was already let go. Nothing broke on the wire:
    the upstream answered (``received_status``, RFC 9209's ``received-status``) with a failure
    the policy retries, so the next hop counts as unavailable for now."""

    answer = outcomes.KILL_SWITCH

    def __init__(self, message: str = "", received_status: int | None = None) -> None:
        super().__init__(message)
        self.received_status = received_status


class NoTimeLeft(AttemptTimeout):
    """The sequence deadline was spent before this attempt could write a byte upstream."""

    answer = outcomes.DEADLINE
    reached_upstream = False


class BadResponse(UpstreamError):
    """The upstream answered with something no client should get: a status outside 100-599,
    a transfer coding other than chunked, a head over the size limits. A property of the
    response, not a transient fault: never retried (nginx's default proxy_next_upstream does
    not retry ``invalid_header`` either)."""

    answer = outcomes.BAD_RESPONSE
    kind = OutcomeKind.BAD_RESPONSE


class TlsCertificateError(UpstreamError):
    """The upstream's TLS certificate was refused (unknown CA, wrong name, expired): the
    handshake stopped before a byte of the request was sent. ``reason`` is OpenSSL's
    verify message, for the log."""

    answer = outcomes.TLS_CERTIFICATE
    kind = OutcomeKind.TLS_CERTIFICATE
    reached_upstream = False


class TlsHandshakeError(UpstreamError):
    """The upstream ended the TLS handshake with an alert (it wanted a client certificate,
    refused ours or our versions), or answered something that is no TLS. Nothing of the
    request was read."""

    answer = outcomes.TLS_HANDSHAKE
    kind = OutcomeKind.TLS_HANDSHAKE
    reached_upstream = False


class BodyTimeout(UpstreamError):
    """The upstream sent no body bytes for the stream idle timeout (after the head)."""

    answer = outcomes.STREAM_IDLE_TIMEOUT


class LocalOverload(Exception):
    """The sidecar itself has no room for the attempt; the upstream was not asked."""

    answer: ClassVar[OutcomeRow] = outcomes.OVERLOADED
    reached_upstream: ClassVar[bool] = False

    @property
    def code(self) -> str:
        return self.answer.code


class PoolExhausted(LocalOverload):
    """Every pooled connection to the upstream stayed busy for the whole pool wait."""

    answer = outcomes.POOL_EXHAUSTED


class Overloaded(LocalOverload):
    """The route's bulkhead stayed full for its whole queue timeout."""

    answer = outcomes.OVERLOADED


class ConcurrencyLimited(LocalOverload):
    """The route's adaptive concurrency limit is reached: latency says the upstream is queueing."""

    answer = outcomes.CONCURRENCY_LIMIT

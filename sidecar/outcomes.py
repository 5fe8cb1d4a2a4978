"""The outcome vocabulary: every way an attempt can fail and every answer the sidecar makes
itself, one row each, as Envoy's ``parseRetryOn`` maps each word to one bit.

A row says, once: its name (the word users write in ``retry.retry_on`` where it is one, the
``attempts_total`` outcome and the span/log label), the ``x-retry-proxy-error`` code, the HTTP
status the sidecar answers with, the RFC 9209 ``Proxy-Status`` error type, the fixed text of
the answer, whether ``retry_on`` lists it by default, and what it means for the breaker, the
adaptive throttle, the adaptive concurrency limit and the endpoint's passive health. Config
parsing, the retry rules, the attempter, the worst-case simulation and the proxy's answers all
read it; the error types of ``sidecar.core`` each name their row. A status the upstream sent
(``OutcomeKind.RESPONSE``) is no row: what it means depends on the route's policy.

Adding a ``retry_on`` word: an ``OutcomeKind`` member and a row here, an error type in
``sidecar.core`` naming the row, and the code that detects it (the upstream client).

Pure data; it imports nothing from the project (the bottom layer, see docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Final


class OutcomeKind(Enum):
    """What one attempt produced: an answer (any status), or a failure with a row below."""

    RESPONSE = auto()
    CONNECT_FAILURE = auto()
    RESET = auto()
    PER_TRY_TIMEOUT = auto()
    # An answer that cannot be relayed as HTTP (bad status, transfer coding, head size): a
    # property of the response, never retried.
    BAD_RESPONSE = auto()
    # The TLS handshake with an ``https://`` upstream failed for good: its certificate refused,
    # or the upstream sent an alert. Nothing of the request was read; never retried.
    TLS_CERTIFICATE = auto()
    TLS_HANDSHAKE = auto()


class Effect(Enum):
    """What an outcome tells one of the route's feedback loops."""

    FAILURE = "failure"  # the breaker: a failed sequence; the throttle: not accepted;
    # the concurrency limit: a latency sample at least this long; the endpoint: a link failure
    SUCCESS = "success"
    NOT_COUNTED = "not counted"  # says nothing about the upstream: left out


NOT_COUNTED: Final = Effect.NOT_COUNTED
FAILURE: Final = Effect.FAILURE


@dataclass(frozen=True, slots=True)
class OutcomeRow:
    name: str  # the label (attempts_total outcome, logs); the retry_on word when ``retry_on``
    status: int | None  # the status the sidecar answers with; None: never an answer of its own
    proxy_status: str | None  # RFC 9209 error type of that answer
    message: str  # its fixed text: no upstream address or internal detail reaches a client
    breaker: Effect
    throttle: Effect
    limit: Effect  # the adaptive concurrency limit
    endpoint: Effect  # the endpoint's passive health
    kind: OutcomeKind | None = None  # the attempt outcome it is, if one
    retry_on: bool = False  # a word users may write in retry.retry_on
    default: bool = False  # in the default retry_on
    # More precise RFC 9209 error types the detecting code may give instead of ``proxy_status``
    # (a connect failure that knows it was refused).
    precise: tuple[str, ...] = ()
    error_code: str | None = None  # the x-retry-proxy-error value, when it is not ``name``
    # The gRPC status of the answer to a gRPC call (``GRPC_CODES``): UNAVAILABLE unless said.
    grpc: int = 14

    @property
    def code(self) -> str:
        """The x-retry-proxy-error value of the sidecar's answer (logs: proxy_error)."""
        return self.name if self.error_code is None else self.error_code


# --- failures of an attempt on the wire (an OutcomeKind each) ---------------------------------
CONNECT_FAILURE: Final = OutcomeRow(
    name="connect-failure",
    status=502,
    proxy_status="destination_unavailable",
    message="the upstream could not be reached",
    breaker=FAILURE,
    throttle=FAILURE,
    limit=NOT_COUNTED,
    endpoint=FAILURE,
    kind=OutcomeKind.CONNECT_FAILURE,
    retry_on=True,
    default=True,
    precise=("connection_refused", "connection_timeout", "dns_error"),
)
RESET: Final = OutcomeRow(
    name="reset",
    error_code="upstream-reset",
    status=502,
    proxy_status="connection_terminated",
    message="the upstream closed the connection without a complete response",
    breaker=FAILURE,
    throttle=FAILURE,
    limit=NOT_COUNTED,
    endpoint=FAILURE,
    kind=OutcomeKind.RESET,
    retry_on=True,
    default=True,
)
PER_TRY_TIMEOUT: Final = OutcomeRow(
    name="per-try-timeout",
    status=504,
    proxy_status="http_response_timeout",
    message="the upstream did not answer within the per-try timeout",
    breaker=FAILURE,
    throttle=FAILURE,
    limit=FAILURE,  # a slow sample: it took at least this long
    endpoint=FAILURE,
    kind=OutcomeKind.PER_TRY_TIMEOUT,
    retry_on=True,
    default=True,
)
BAD_RESPONSE: Final = OutcomeRow(
    name="bad-response",
    status=502,
    proxy_status="http_protocol_error",
    message="the upstream sent a response that cannot be relayed",
    breaker=FAILURE,
    throttle=FAILURE,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,  # the link worked: the answer was wrong
    kind=OutcomeKind.BAD_RESPONSE,
    grpc=13,  # INTERNAL: the answer was wrong, not missing
    precise=(
        "http_response_transfer_coding",
        "http_response_header_section_size",
        "http_upgrade_failed",  # also a 101 nobody asked for
    ),
)
# --- the TLS handshake with an https:// upstream failed for good -------------------------------
# Never retried: the next try meets the same certificate (the same refusal). Not a failure for
# the breaker for "down": the upstream is up and answering, it is the trust between the two that
# is wrong, and an open breaker would only hide this precise answer behind breaker-open. A
# failure of the endpoint's passive health, as Envoy's outlier detection counts a TLS failure as
# a local-origin connect failure: of a name's several addresses, one with a bad certificate is
# ejected and the others take the traffic.
TLS_CERTIFICATE: Final = OutcomeRow(
    name="tls-certificate",
    status=502,
    proxy_status="tls_certificate_error",
    message="the upstream's TLS certificate was refused",
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=FAILURE,
    kind=OutcomeKind.TLS_CERTIFICATE,
)
TLS_HANDSHAKE: Final = OutcomeRow(
    name="tls-handshake",
    status=502,
    proxy_status="tls_alert_received",
    message="the TLS handshake with the upstream failed",
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=FAILURE,
    kind=OutcomeKind.TLS_HANDSHAKE,
    precise=("tls_protocol_error",),  # no alert: the upstream does not speak TLS (or not ours)
)
# --- the sidecar had no room: the upstream was not asked --------------------------------------
OVERLOADED: Final = OutcomeRow(
    name="overloaded",
    status=503,
    proxy_status="connection_limit_reached",
    message="the route has no room for the request",
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
POOL_EXHAUSTED: Final = OutcomeRow(
    name="pool-exhausted",
    status=503,
    proxy_status="connection_limit_reached",
    message="every connection to the upstream stayed busy",
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
CONCURRENCY_LIMIT: Final = OutcomeRow(
    name="concurrency-limit",
    status=503,
    proxy_status="connection_limit_reached",
    message="the upstream is queueing: the route's concurrency limit is reached",
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
DEADLINE: Final = OutcomeRow(
    name="deadline",
    status=504,
    proxy_status="http_response_timeout",
    message="the request deadline passed before the upstream answered",
    grpc=4,  # DEADLINE_EXCEEDED
    breaker=NOT_COUNTED,  # spent before a byte was written (unless an earlier attempt failed)
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
# --- answers about the route's policy ----------------------------------------------------------
BREAKER_OPEN: Final = OutcomeRow(
    name="breaker-open",
    status=503,
    proxy_status="destination_unavailable",
    message="the route's circuit breaker is open",
    breaker=NOT_COUNTED,
    throttle=FAILURE,  # a request the breaker rejects is one the upstream did not accept
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
KILL_SWITCH: Final = OutcomeRow(
    name="kill-switch",
    status=503,
    proxy_status="destination_unavailable",  # with received-status: the upstream's answer
    message="the upstream failed and the kill switch stopped the retry",
    breaker=FAILURE,  # the upstream's failed answer, whose retry was stopped
    throttle=NOT_COUNTED,  # that attempt counted already
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
# --- after the head was relayed: a label only -------------------------------------------------
STREAM_IDLE_TIMEOUT: Final = OutcomeRow(
    name="stream-idle-timeout",
    status=None,  # the head is out: the body is cut
    proxy_status="http_response_timeout",
    message="the upstream stopped sending the response body",
    breaker=FAILURE,  # an upstream that died mid-body
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
CANCELLED: Final = OutcomeRow(
    name="cancelled",  # a hedge that lost, an attempt the deadline or the client cut
    status=None,
    proxy_status=None,
    message="the attempt was cancelled",
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
# --- the sidecar itself -------------------------------------------------------------------------
INTERNAL: Final = OutcomeRow(
    name="internal",
    status=502,
    proxy_status="proxy_internal_error",
    message="internal error in the sidecar",
    grpc=13,  # INTERNAL
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
# A guarded write refused because the idempotency store cannot answer (on_store_error: refuse):
# the sidecar's own dependency failed, not the app nor a bug.
IDEMPOTENCY_STORE: Final = OutcomeRow(
    name="idempotency-store",
    status=503,
    proxy_status="proxy_internal_error",
    message="the idempotency store cannot answer",
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)
# Requests refused before any upstream was chosen; the status varies (``REFUSALS``).
BAD_REQUEST: Final = OutcomeRow(
    name="bad-request",
    status=400,
    proxy_status="http_request_error",
    message="bad request",  # each refusal says what was wrong
    breaker=NOT_COUNTED,
    throttle=NOT_COUNTED,
    limit=NOT_COUNTED,
    endpoint=NOT_COUNTED,
)

ROWS: Final[tuple[OutcomeRow, ...]] = (
    CONNECT_FAILURE,
    RESET,
    PER_TRY_TIMEOUT,
    BAD_RESPONSE,
    TLS_CERTIFICATE,
    TLS_HANDSHAKE,
    OVERLOADED,
    POOL_EXHAUSTED,
    CONCURRENCY_LIMIT,
    DEADLINE,
    BREAKER_OPEN,
    KILL_SWITCH,
    STREAM_IDLE_TIMEOUT,
    CANCELLED,
    INTERNAL,
    IDEMPOTENCY_STORE,
    BAD_REQUEST,
)
# The sidecar's own answers that stand for an answer the app gave (its head came, refused as
# unrelayable): the app began the write, so a guarded write's key is finished with this answer,
# never released for a retry to run it again (``proxy/guarded.py``). No other row is: a
# connect failure, an overload, a refusal never reached the app; a reset or a per-try timeout
# after the request went out may or may not have, and the route's retry policy decides.
APP_ANSWERED: Final = frozenset({BAD_RESPONSE.code})
BY_KIND: Final[dict[OutcomeKind, OutcomeRow]] = {r.kind: r for r in ROWS if r.kind is not None}
BY_CODE: Final[dict[str, OutcomeRow]] = {r.code: r for r in ROWS}

# The refusals before routing (x-retry-proxy-error: bad-request), by status, with their
# Proxy-Status error where it is not BAD_REQUEST's.
REFUSALS: Final[dict[int, str]] = {
    400: "http_request_error",  # malformed, unsupported version or target, client gone
    404: "destination_not_found",  # no route matches
    408: "http_request_error",  # a head or body too slow
    413: "http_request_denied",  # a body over limits.max_request_body
    417: "http_request_error",  # an Expect other than 100-continue
    431: "http_request_error",  # a head too large
    503: "destination_unavailable",  # a gRPC call on a route that does not speak HTTP/2 upstream
}

# retry_on: the words, each one outcome kind, and the status groups.
RETRY_ON_WORDS: Final[dict[str, OutcomeKind]] = {
    r.name: r.kind for r in ROWS if r.retry_on and r.kind is not None
}
STATUS_GROUPS: Final[dict[str, tuple[int, ...]]] = {
    "5xx": tuple(range(500, 600)),
    "gateway-error": (502, 503, 504),
}
DEFAULT_RETRY_KINDS: Final = frozenset(
    r.kind for r in ROWS if r.retry_on and r.default and r.kind is not None
)
DEFAULT_RETRY_STATUSES: Final = frozenset(STATUS_GROUPS["gateway-error"])


def label(kind: OutcomeKind) -> str:
    """The name of an attempt's failure kind (``RESPONSE`` has none: its status is its label)."""
    return BY_KIND[kind].name


# --- gRPC ----------------------------------------------------------------------------------------
# The status names by code (gRPC's status codes 0-16): the label of grpc_calls_total{code}.
GRPC_CODES: Final[tuple[str, ...]] = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)
# The gRPC status words of ``retry.retry_on`` (Envoy's ``retry-grpc-on``), each a code; the
# default list has ``unavailable``.
GRPC_RETRY_ON: Final[dict[str, int]] = {
    "cancelled": 1,
    "deadline-exceeded": 4,
    "internal": 13,
    "resource-exhausted": 8,
    "unavailable": 14,
}
GRPC_OK: Final = 0
GRPC_CANCELLED: Final = 1
GRPC_UNKNOWN: Final = 2
GRPC_INTERNAL: Final = 13
GRPC_UNAVAILABLE: Final = 14
DEFAULT_RETRY_GRPC: Final = frozenset({GRPC_UNAVAILABLE})
# What a gRPC client makes of an HTTP status (gRPC's HTTP-to-gRPC mapping): the status of the
# sidecar's own refusals of a gRPC call; any other status is UNKNOWN (2).
GRPC_OF_HTTP: Final[dict[int, int]] = {
    400: 13,
    401: 16,
    403: 7,
    404: 12,
    413: 8,
    429: 14,
    431: 8,
    502: 14,
    503: 14,
    504: 14,
}


def grpc_status_value(value: bytes) -> int:
    """A ``grpc-status`` field's code; UNKNOWN when it is not a number, as gRPC reads it."""
    return int(value) if value.isdigit() and len(value) <= 3 else GRPC_UNKNOWN


def grpc_name(code: int) -> str:
    """The name of a gRPC status code; an unknown code is UNKNOWN, as gRPC reads it."""
    return GRPC_CODES[code] if 0 <= code < len(GRPC_CODES) else GRPC_CODES[2]

"""The upstream client's own error types. All aiohttp/asyncio/OS errors are mapped here."""

from __future__ import annotations

import socket

from sidecar.retry.classify import OutcomeKind


class UpstreamError(Exception):
    kind: OutcomeKind = OutcomeKind.RESET
    code: str = "upstream-reset"  # the x-retry-proxy-error value when the sidecar answers
    status: int = 502
    # The RFC 9209 Proxy-Status error type of the answer the sidecar makes from this error.
    proxy_status: str = "connection_terminated"


class ConnectFailure(UpstreamError):
    """No byte of the request left this process: the connection could not be made."""

    kind = OutcomeKind.CONNECT_FAILURE
    code = "connect-failure"
    proxy_status = "destination_unavailable"

    def __init__(self, message: str, proxy_status: str | None = None) -> None:
        super().__init__(message)
        if proxy_status is not None:
            self.proxy_status = proxy_status


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


class BadResponse(UpstreamError):
    """The upstream answered with something no client should get: a status outside 100-599,
    a transfer coding other than chunked, a head over the size limits. A property of the
    response, not a transient fault: never retried (nginx's default proxy_next_upstream does
    not retry ``invalid_header`` either)."""

    kind = OutcomeKind.BAD_RESPONSE
    code = "bad-response"

    def __init__(self, message: str, proxy_status: str = "http_protocol_error") -> None:
        super().__init__(message)
        self.proxy_status = proxy_status


class BodyTimeout(UpstreamError):
    """The upstream sent no body bytes for the stream idle timeout (after the head)."""

    code = "stream-idle-timeout"
    proxy_status = "http_response_timeout"


class LocalOverload(Exception):
    """The sidecar itself has no room for the attempt; the upstream was not asked."""

    code = "overloaded"
    status = 503
    proxy_status = "connection_limit_reached"


class PoolExhausted(LocalOverload):
    """Every pooled connection to the upstream stayed busy for the whole pool wait."""

    code = "pool-exhausted"


class Overloaded(LocalOverload):
    """The route's bulkhead stayed full for its whole queue timeout."""

    code = "overloaded"

"""The upstream client's own error types. All aiohttp/asyncio/OS errors are mapped here."""

from __future__ import annotations

from sidecar.retry.classify import OutcomeKind


class UpstreamError(Exception):
    kind: OutcomeKind = OutcomeKind.RESET
    code: str = "upstream-reset"  # the x-retry-proxy-error value when the sidecar answers
    status: int = 502


class ConnectFailure(UpstreamError):
    """No byte of the request left this process: the connection could not be made."""

    kind = OutcomeKind.CONNECT_FAILURE
    code = "connect-failure"


class UpstreamReset(UpstreamError):
    """The connection broke, or the upstream spoke something other than HTTP/1.x."""

    kind = OutcomeKind.RESET
    code = "upstream-reset"


class AttemptTimeout(UpstreamError):
    """No complete response head within the per-try timeout."""

    kind = OutcomeKind.PER_TRY_TIMEOUT
    code = "per-try-timeout"
    status = 504


class LocalOverload(Exception):
    """The sidecar itself has no room for the attempt; the upstream was not asked."""

    code = "overloaded"
    status = 503


class PoolExhausted(LocalOverload):
    """Every pooled connection to the upstream stayed busy for the whole pool wait."""

    code = "pool-exhausted"


class Overloaded(LocalOverload):
    """The route's bulkhead stayed full for its whole queue timeout."""

    code = "overloaded"

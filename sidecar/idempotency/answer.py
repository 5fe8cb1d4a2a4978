"""An answer as the guard sees it: what the app said (``Forwarded``, read from the request
path's one outcome, ``engine.answered.Answered``, by ``forwarded_of``) and what the sidecar
says itself or replays (``Answer``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sidecar import outcomes
from sidecar.engine.answered import Answered

Headers = tuple[tuple[bytes, bytes], ...]

# Framing and hop-by-hop fields: never kept (a replay is framed anew from the kept body).
NOT_KEPT_HEADERS = frozenset(
    {
        b"connection",
        b"content-length",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)


@dataclass(frozen=True, slots=True)
class Answer:
    """A whole answer: status, end-to-end headers, body."""

    status: int
    headers: Headers
    body: bytes

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)


@dataclass(frozen=True, slots=True)
class Forwarded:
    """What ``forward`` gives back: the app's answer, and whether the route would retry it."""

    status: int
    headers: Headers
    body: bytes | None  # None: streamed to the client, not held (too large to buffer)
    # The route would retry this: a status in ``retry_on``, a connect failure, a reset, a
    # timeout, or an answer the sidecar made itself. Such an answer releases the key.
    retryable: bool


# Answers that say the app did not begin the write: too early (425, RFC 8470), the request
# timed out before it was read (408), too many requests (429, RFC 6585). They release the key
# as a status in ``retry_on`` does, so the client's retry runs (as payment providers keep only
# answers of requests they began to execute); so does an error that asks the client to come
# back (``Retry-After`` on a 4xx or 5xx). A 2xx or 3xx with ``Retry-After`` (a 202 to poll)
# says the app acted: kept.
NOT_BEGUN_STATUSES = frozenset({408, 425, 429})
RETRY_AFTER = b"retry-after"


def not_begun(status: int, headers: Iterable[tuple[bytes, bytes]]) -> bool:
    """The app's answer says it did not begin the write: the key is released. Pure."""
    if status in NOT_BEGUN_STATUSES:
        return True
    return status >= 400 and any(k.lower() == RETRY_AFTER for k, _ in headers)


def kept_headers(headers: Headers) -> Headers:
    return tuple((k, v) for k, v in headers if k.lower() not in NOT_KEPT_HEADERS)


def forwarded_of(answered: Answered, retry_statuses: frozenset[int]) -> Forwarded:
    """What the guard judges of a request's answer. Pure. The route would retry it (so the key
    is released): a status in ``retry_on`` (``retry_statuses``), an answer that says the app
    did not begin the write (``not_begun``: 408, 425, 429, an error with ``Retry-After``), an
    answer a sidecar made itself (a connect failure, a reset, a timeout, an open breaker; an
    inner sidecar's too), but for one that stands for the app's answer
    (``outcomes.APP_ANSWERED``: a head it sent that cannot be relayed), which finishes the key
    with the 502 the client got. An answer whose body broke after its head came is the app's
    answer all the same: only its status is kept. A write the DLQ stored is not released: its
    key is finished with the answer the client got (202 or the failure with
    ``x-retry-dlq: stored``), so no duplicate runs it beside the DLQ's replay."""
    stored = answered.dlq_stored
    if not answered.from_upstream:  # the sidecar's own answer (no upstream response, a 202)
        app_answered = answered.proxy_error in outcomes.APP_ANSWERED
        retryable = not (stored or app_answered)
    else:
        status = answered.status
        retryable = (
            answered.upstream_error is not None
            or status in retry_statuses
            or not_begun(status, answered.headers)
        )
        retryable = retryable and not stored
    return Forwarded(answered.status, answered.headers, answered.body, retryable)

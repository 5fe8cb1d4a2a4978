"""What goes into the DLQ, in what shape, and what may be resent without a human. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config.model import RetryPolicy
from sidecar.core import Fate
from sidecar.retry.classify import may_resend

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CREDENTIALS = frozenset({"authorization", "cookie", "proxy-authorization"})
# Re-framed on replay, or set by the replay itself: never stored.
_NOT_STORED = frozenset({"content-length", "transfer-encoding", "x-retry-replay"})
# Fates where the sidecar itself decided the request was not the edge's to keep, or was the
# caller's own doing: never stored.
_NEVER = frozenset({Fate.EDGE_OWNED, Fate.SUCCESS})


@dataclass(frozen=True, slots=True)
class KeptBody:
    """The request body as the DLQ may keep it: whole, or not at all.

    ``data`` is None when the body was streamed upstream (over ``retry.max_body_bytes``): the
    sidecar never held it whole, so there is nothing truthful to store, and a stand-in (an empty
    body) must never be stored or acknowledged. A request without a body keeps ``b""``.
    """

    data: bytes | None

    @classmethod
    def of(cls, body: object) -> KeptBody:
        """From the proxy's request body: None (no body), bytes (buffered whole) or a stream."""
        if body is None:
            return cls(b"")
        if isinstance(body, bytes | bytearray | memoryview):
            return cls(bytes(body))
        return cls(None)


@dataclass(frozen=True, slots=True)
class NewRecord:
    route: str
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    fate: str
    attempts: int
    last_status: int | None
    last_error: str | None
    idempotency_key: str | None
    created_at: float  # epoch seconds
    # Whether any byte of the request may have reached the upstream (False only when every
    # attempt failed before sending: connect failure, local overload, breaker refusal).
    reached_upstream: bool = True

    @property
    def size(self) -> int:
        return len(self.body) + sum(len(k) + len(v) for k, v in self.headers) + len(self.target)


def transient_failure(fate: Fate, final_status: int | None, errored: bool) -> bool:
    """A transient-class end: an upstream error (connect, reset, timeout), a 5xx, or a refusal
    by the sidecar itself (breaker open, budget, deadline). 4xx answers are the caller's."""
    if fate in _NEVER:
        return False
    if fate is Fate.BREAKER_OPEN:
        return True
    if errored:
        return True
    return final_status is not None and final_status >= 500


def idempotency_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The request's Idempotency-Key; an empty or blank value is no key at all."""
    for k, v in headers:
        if k.lower() == b"idempotency-key":
            value = v.decode("latin-1").strip()
            if value:
                return value
    return None


def storable_headers(
    headers: list[tuple[bytes, bytes]],
    keep_credentials: bool,
    drop: frozenset[str] = frozenset(),
) -> list[tuple[str, str]]:
    """The request headers worth keeping (hop-by-hop already removed by the proxy): without
    credentials (unless kept), without the route's ``drop_headers`` (lower-case names)."""
    out = []
    for k, v in headers:
        name = k.decode("latin-1")
        lk = name.lower()
        if lk in _NOT_STORED or lk in drop:
            continue
        if not keep_credentials and lk in CREDENTIALS:
            continue
        out.append((name, v.decode("latin-1")))
    return out


def safe_to_resend(
    policy: RetryPolicy, method: str, key: str | None, reached_upstream: bool | None
) -> bool:
    """May the redrive resend this record without a human?

    Yes when nothing of it reached the upstream, or when the route's own rule for live retries
    allows resending it (an idempotent method; an Idempotency-Key under
    ``with-idempotency-key``; anything under ``always``). ``reached_upstream`` None (a record
    from before this was recorded) counts as reached.
    """
    if reached_upstream is False:
        return True
    return may_resend(policy, method, key is not None and key.strip() != "")

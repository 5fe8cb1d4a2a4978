"""What goes into the DLQ, and in what shape. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.core import Fate

WRITE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
CREDENTIALS = frozenset({b"authorization", b"cookie", b"proxy-authorization"})
# Fates where the sidecar itself decided the request was not the edge's to keep, or was the
# caller's own doing: never stored.
_NEVER = frozenset({Fate.EDGE_OWNED, Fate.SUCCESS})


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


def storable_headers(
    headers: list[tuple[bytes, bytes]], keep_credentials: bool
) -> list[tuple[str, str]]:
    """The request headers worth keeping (hop-by-hop already removed by the proxy)."""
    out = []
    for k, v in headers:
        lk = k.lower()
        if not keep_credentials and lk in CREDENTIALS:
            continue
        if lk in (b"content-length", b"transfer-encoding", b"x-retry-replay"):
            continue
        out.append((k.decode("latin-1"), v.decode("latin-1")))
    return out

"""An answer as the guard sees it: what the app said (``Forwarded``) and what the sidecar says
itself or replays (``Answer``)."""

from __future__ import annotations

from dataclasses import dataclass

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


def kept_headers(headers: Headers) -> Headers:
    return tuple((k, v) for k, v in headers if k.lower() not in NOT_KEPT_HEADERS)

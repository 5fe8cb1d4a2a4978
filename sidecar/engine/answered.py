"""What a request was answered: the one outcome of the request path.

The proxy makes one ``Answered`` per request once its answer went out (or was held for the
idempotency guard): the relay of an upstream response, or an answer the sidecar made itself
(a refusal, an error, the DLQ's 202, a problem or a replay of the guard). The idempotency guard
reads it to keep or release a key, and the request is counted and its span ended from it, in
one place (``proxy/handler.py``). It names no protocol: an HTTP/1.1 front end and an HTTP/2
one make the same.

Frozen: every field is ``Final``, set once by ``__init__`` (an explicit one: mypyc compiles it,
one is made per request).
"""

from __future__ import annotations

from typing import Final

from sidecar.core import Fate

RawHeaders = tuple[tuple[bytes, bytes], ...]

# nginx's status for "client closed the request", in metrics, logs and the span.
CLIENT_CLOSED = 499


class Answered:
    """See the module docstring."""

    __slots__ = (
        "attempts",
        "body",
        "dlq",
        "dlq_id",
        "endpoint",
        "fate",
        "from_upstream",
        "headers",
        "proxy_error",
        "sent",
        "status",
        "upstream_error",
    )

    def __init__(
        self,
        status: int,
        headers: RawHeaders,
        fate: str,
        attempts: int,
        *,
        body: bytes | None = None,
        proxy_error: str | None = None,
        from_upstream: bool = False,
        upstream_error: bytes | None = None,
        dlq: str | None = None,
        dlq_id: str | None = None,
        sent: int = 0,
        endpoint: str = "",
    ) -> None:
        # The status the client got (or was to get: a held answer).
        self.status: Final = status
        # The answer's end-to-end fields, as a duplicate would be told them: the upstream's
        # (hop-by-hop ones out) and the DLQ's; for an answer the sidecar made, all of its own.
        self.headers: Final = headers
        self.fate: Final = fate  # a Fate's value, or body-broken / client-gone
        self.attempts: Final = attempts
        # The whole body when it is known (the sidecar's own answers, an answer held whole);
        # None: relayed as it came, or broken mid-body.
        self.body: Final = body
        # The outcome row's code when this sidecar answered itself, or when an upstream answer
        # broke mid-body (x-retry-proxy-error, the span's error type).
        self.proxy_error: Final = proxy_error
        # True: the head came from the upstream (the app acted, whatever came after).
        self.from_upstream: Final = from_upstream
        # An upstream answer a sidecar further down made itself (its x-retry-proxy-error),
        # not the app: the route would retry it.
        self.upstream_error: Final = upstream_error
        # What the DLQ did with the write (the x-retry-dlq value: stored, full, unavailable,
        # body-too-large), None when it was not asked; the record's id once stored.
        self.dlq: Final = dlq
        self.dlq_id: Final = dlq_id
        self.sent: Final = sent  # body bytes written to the client
        self.endpoint: Final = endpoint  # the upstream endpoint whose answer this is, or ""

    def with_sent(self, sent: int) -> Answered:
        """The same answer, ``sent`` body bytes written (a held answer, once released)."""
        return Answered(
            self.status,
            self.headers,
            self.fate,
            self.attempts,
            body=self.body,
            proxy_error=self.proxy_error,
            from_upstream=self.from_upstream,
            upstream_error=self.upstream_error,
            dlq=self.dlq,
            dlq_id=self.dlq_id,
            sent=sent,
            endpoint=self.endpoint,
        )

    @property
    def dlq_stored(self) -> bool:
        """The DLQ holds the write durably: its replay is the one that may run it again."""
        return self.dlq_id is not None

    def header(self, name: bytes) -> bytes | None:
        """The first field named ``name`` (lowercase), or None."""
        for k, v in self.headers:
            if k.lower() == name:
                return v
        return None


def client_gone() -> Answered:
    """The client left before its answer: nobody answered, nothing to blame upstream for."""
    return Answered(CLIENT_CLOSED, (), Fate.CLIENT_GONE.value, 0)

"""The sidecar's own answers (``Made``): about the upstream or the route's policy, each from its
row of the outcome table (``own_answer``), and the refusals of a request routed nowhere
(``refusal``), written through the front end's sink (``send_made``). They carry
``x-retry-proxy-error`` and the standard ``Proxy-Status`` (RFC 9209), a ``Date``, and no
``Server`` version banner. ``SidecarResponse`` and ``client_error`` are the same as aiohttp
responses, for the answers a listener writes before any handler runs.
"""

from __future__ import annotations

import json
import time
from email.utils import formatdate
from typing import Final

from aiohttp import web

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.engine.answered import Answered
from sidecar.outcomes import OutcomeRow
from sidecar.proxy.frontend import Head, RawHeaders, ResponseSink

PROXY_NAME = "retry-sidecar"  # the Proxy-Status member naming this intermediary


def proxy_status(error_type: str | None = None, received_status: int | None = None) -> str:
    value = PROXY_NAME if error_type is None else f"{PROXY_NAME}; error={error_type}"
    if received_status is not None:
        value += f"; received-status={received_status}"  # RFC 9209 section 2.1.4
    return value


class SidecarResponse(web.Response):
    """An answer made by the sidecar itself: aiohttp's ``Server`` banner is removed."""

    async def _prepare_headers(self) -> None:
        await super()._prepare_headers()
        self._headers.popall("Server", None)


class Made:
    """An answer the sidecar makes itself, whole: status, fields, body. ``head`` frames it for
    a sink: its ``Content-Length`` and ``Date`` after its fields."""

    __slots__ = ("body", "fields", "status")

    def __init__(self, status: int, fields: RawHeaders, body: bytes) -> None:
        self.status: Final = status
        self.fields: Final = fields
        self.body: Final = body

    def plus(self, extra: RawHeaders) -> Made:
        """The same answer with more fields."""
        return Made(self.status, self.fields + extra, self.body)

    def header(self, name: str) -> str | None:
        low = name.lower().encode("latin-1")
        return next((v.decode("latin-1") for k, v in self.fields if k.lower() == low), None)

    def head(self, close: bool = False) -> Head:
        length = len(self.body)
        framing = [(b"Content-Length", b"%d" % length), (b"Date", http_date())]
        return Head(self.status, self.fields + framing, [], length, close)


_DATE: list[tuple[int, bytes]] = [(0, b"")]


def http_date() -> bytes:
    """The ``Date`` of an answer made now (IMF-fixdate), made once a second."""
    now = int(time.time())
    cached = _DATE[0]
    if cached[0] != now:
        cached = _DATE[0] = (now, formatdate(now, usegmt=True).encode("ascii"))
    return cached[1]


def own_answer(
    row: OutcomeRow,
    fate: Fate,
    attempts: int,
    error_type: str | None = None,
    *,
    received_status: int | None = None,
    message: str | None = None,
) -> Made:
    """A response made by the sidecar itself, about the upstream or the route's policy: its
    status, ``x-retry-proxy-error``, ``Proxy-Status`` error and text from its row of the
    outcome table. ``error_type``: a more precise RFC 9209 error type than the row's (a connect
    failure that knows it was refused); ``received_status``: the status the upstream answered,
    when the sidecar did not relay it; ``message``: a text more precise than the row's."""
    assert row.status is not None, f"{row.name} is never an answer of the sidecar's"
    fate_s = fate.value
    text = row.message if message is None else message
    body = json.dumps({"error": text, "fate": fate_s, "attempts": attempts}).encode()
    status = proxy_status(error_type or row.proxy_status, received_status)
    return Made(
        row.status,
        [
            (b"Content-Type", b"application/json"),
            (b"Proxy-Status", status.encode("latin-1")),
            (b"x-retry-proxy-error", row.code.encode("latin-1")),
            (b"x-retry-attempts", b"%d" % attempts),
            (b"x-retry-fate", fate_s.encode("latin-1")),
        ],
        body,
    )


def refusal(status: int, message: str) -> Made:
    """A 4xx for a request the sidecar refuses before routing it anywhere."""
    error = outcomes.REFUSALS.get(status, outcomes.BAD_REQUEST.proxy_status)
    return Made(
        status,
        [
            (b"Content-Type", b"application/json"),
            (b"Proxy-Status", proxy_status(error).encode("latin-1")),
            (b"x-retry-proxy-error", outcomes.BAD_REQUEST.code.encode("latin-1")),
        ],
        json.dumps({"error": message}).encode(),
    )


def client_error(status: int, message: str) -> web.Response:
    """``refusal`` as an aiohttp response: the listener's own refusals, written before any
    handler runs (``proxy/server.py``)."""
    made = refusal(status, message)
    return SidecarResponse(
        status=status,
        body=made.body,
        headers={k.decode("latin-1"): v.decode("latin-1") for k, v in made.fields},
    )


def send_made(
    sink: ResponseSink,
    made: Made,
    fate: Fate | str,
    attempts: int,
    *,
    proxy_error: str | None = None,
    close: bool = False,
) -> Answered:
    """Write an answer the sidecar made through ``sink``: what the client got."""
    head = made.head(close)
    sink.whole(head, made.body)
    dlq = made.header("x-retry-dlq")
    return Answered(
        made.status,
        tuple(head.fields),
        str(fate),
        attempts,
        body=made.body,
        proxy_error=proxy_error,
        dlq=dlq,
        dlq_id=made.header("x-retry-dlq-id") if dlq is not None else None,
        sent=sink.sent,
    )

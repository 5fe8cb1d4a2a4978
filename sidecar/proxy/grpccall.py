"""A gRPC call on the request path: what makes a request one, its deadline (``grpc-timeout``),
and the sink that turns the sidecar's own answers into gRPC answers.

A gRPC client reads an HTTP 502/503 with a text body as a bare UNAVAILABLE or UNKNOWN and loses
what the sidecar said; so every answer the sidecar makes to a gRPC call (a connect failure, the
breaker, a kill switch, the budget, the deadline, an overload, a refusal before routing) goes
out as gRPC's Trailers-Only answer: HTTP 200, ``content-type: application/grpc``, the
``grpc-status`` of its row of the outcome table (UNAVAILABLE; DEADLINE_EXCEEDED for the
deadline; INTERNAL for a bad response; a refusal by gRPC's own HTTP-to-gRPC mapping), the text
as ``grpc-message``, and the usual ``x-retry-*`` fields. The upstream's answers pass as they
came. ``GrpcSink`` also notes the final status the client got, for ``grpc_calls_total``.
"""

from __future__ import annotations

import json

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.proxy.frontend import Head, RawHeaders, ResponseSink

GRPC_TYPE = b"application/grpc"
GRPC_STATUS = b"grpc-status"
# grpc-timeout units (at most 8 digits and one of these), in milliseconds per unit.
_UNITS = {"H": 3_600_000.0, "M": 60_000.0, "S": 1000.0, "m": 1.0, "u": 0.001, "n": 0.000_001}
# The fields of the sidecar's own answer that a gRPC answer keeps (its framing is gRPC's).
_KEPT = frozenset({b"proxy-status", b"date", b"x-retry-dlq", b"x-retry-dlq-id"})


def is_grpc(content_type: str | None) -> bool:
    """``application/grpc``, ``application/grpc+proto``, ``application/grpc;...``."""
    if content_type is None:
        return False
    ct = content_type.strip().lower()
    return ct == "application/grpc" or ct.startswith(("application/grpc+", "application/grpc;"))


def grpc_timeout_ms(value: str | None) -> int | None:
    """A ``grpc-timeout`` (1-8 digits and a unit) in whole milliseconds, rounded down: 0 (a
    deadline already passed: the call is answered DEADLINE_EXCEEDED, never sent) for less than
    one; None when absent or malformed (then it bounds nothing, as gRPC servers ignore it)."""
    if value is None:
        return None
    v = value.strip()
    digits, unit = v[:-1], v[-1:]
    if not (1 <= len(digits) <= 8 and digits.isdigit() and digits.isascii()) or unit not in _UNITS:
        return None
    return int(int(digits) * _UNITS[unit])


def percent_encoded(text: str) -> bytes:
    """A ``grpc-message`` value: UTF-8, bytes outside printable ASCII and ``%`` as ``%XX``."""
    out = bytearray()
    for b in text.encode("utf-8"):
        if 0x20 <= b <= 0x7E and b != 0x25:
            out.append(b)
        else:
            out += b"%%%02X" % b
    return bytes(out)


def status_in(fields: RawHeaders | tuple[tuple[bytes, bytes], ...]) -> int:
    """The ``grpc-status`` among ``fields`` (the last one, as gRPC clients read a repeated
    one); -1 when there is none."""
    code = -1
    for k, v in fields:
        if k.lower() == GRPC_STATUS:
            code = outcomes.grpc_status_value(v)
    return code


def own_grpc_answer(head: Head, body: bytes) -> tuple[Head, int]:
    """The sidecar's own answer ``head`` (and its JSON body) as a Trailers-Only gRPC answer,
    and its gRPC status."""
    code_b = next((v for k, v in head.fields if k.lower() == b"x-retry-proxy-error"), None)
    row = outcomes.BY_CODE.get(code_b.decode("latin-1")) if code_b is not None else None
    code = status_in(head.fields)  # the status of the failure itself, where it is known
    if code >= 0:
        pass
    elif row is None or row is outcomes.BAD_REQUEST or row.status != head.status:
        code = outcomes.GRPC_OF_HTTP.get(head.status, outcomes.GRPC_UNKNOWN)
    else:
        code = row.grpc
    try:
        text = str(json.loads(body).get("error", ""))
    except (ValueError, AttributeError):
        text = ""
    fields: RawHeaders = [
        (b"content-type", GRPC_TYPE),
        (GRPC_STATUS, b"%d" % code),
        # An HTTP/1.1 client needs the framing (there is no END_STREAM): an empty body.
        (b"content-length", b"0"),
    ]
    if text:
        fields.append((b"grpc-message", percent_encoded(text)))
    for k, v in head.fields:
        lk = k.lower()
        if lk in _KEPT or lk.startswith(b"x-retry-"):
            fields.append((k, v))
    return Head(200, fields, head.own, 0, head.close), code


class GrpcSink:
    """The front end's sink for a gRPC call (see the module docstring). ``code``: the gRPC
    status the client got (-1 until known)."""

    __slots__ = ("_sink", "code")

    def __init__(self, sink: ResponseSink) -> None:
        self._sink = sink
        self.code = -1

    @property
    def whole_limit(self) -> int:
        return self._sink.whole_limit

    @property
    def sent(self) -> int:
        return self._sink.sent

    def gone(self) -> bool:
        return self._sink.gone()

    async def interim(self, status: int, fields: RawHeaders) -> None:
        await self._sink.interim(status, fields)

    def _note(self, head: Head) -> None:
        if head.status != 200:
            self.code = outcomes.GRPC_OF_HTTP.get(head.status, outcomes.GRPC_UNKNOWN)
        else:
            self.code = status_in(head.fields)

    def whole(self, head: Head, body: bytes) -> None:
        if head.from_upstream:
            self._note(head)
            self._sink.whole(head, body)
            return
        made, self.code = own_grpc_answer(head, body)
        self._sink.whole(made, b"")

    async def start(self, head: Head) -> None:
        self._note(head)
        await self._sink.start(head)

    async def write(self, chunk: bytes) -> None:
        await self._sink.write(chunk)

    async def end(self, trailers: RawHeaders | None = None) -> None:
        if trailers:
            code = status_in(trailers)
            if code >= 0:
                self.code = code
        await self._sink.end(trailers)

    def abort(self) -> None:
        # The client sees its stream reset (INTERNAL_ERROR): gRPC reports INTERNAL.
        self.code = outcomes.GRPC_INTERNAL
        self._sink.abort()

    def code_name(self, fate: str) -> str:
        """The final status for ``grpc_calls_total``: CANCELLED for a client that left before
        its answer, UNKNOWN for any other call that got no status."""
        code = self.code
        if code < 0:
            code = outcomes.GRPC_CANCELLED if fate == Fate.CLIENT_GONE else outcomes.GRPC_UNKNOWN
        return outcomes.grpc_name(code)

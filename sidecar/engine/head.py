"""The request head every attempt of a sequence sends: the request line, the shared headers and
this sidecar's edge marker (``x-retry-edge``; also the W3C ``tracestate`` member
``retry-sidecar=edge`` when a ``traceparent`` goes upstream with it)."""

from __future__ import annotations

import re
from collections.abc import Iterable

TRACESTATE_KEY = b"retry-sidecar"
EDGE_MEMBER = TRACESTATE_KEY + b"=edge"
MAX_TRACESTATE_MEMBERS = 32  # W3C Trace Context: at most 32 list members
TRACEPARENT = b"traceparent"

# W3C Trace Context section 3.2: version "-" trace-id "-" parent-id "-" trace-flags, lower-case
# hex; a version after 00 may append "-" and more.
_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}(-.*)?", re.S)


def valid_traceparent(value: bytes) -> bool:
    """Whether ``value`` is a ``traceparent`` a W3C tracer would continue: version ``ff`` is
    invalid, version ``00`` has nothing after the flags, an all-zero trace-id or parent-id is
    invalid. A tracer discards the ``tracestate`` of any other (section 3.3.1.1)."""
    m = _TRACEPARENT.fullmatch(value)
    if m is None:
        return False
    version, trace_id, parent_id, rest = m.groups()
    return (
        version != b"ff"
        and not (version == b"00" and rest is not None)
        and trace_id != b"0" * 32
        and parent_id != b"0" * 16
    )


def edge_head(
    method: str,
    target: str,
    headers: Iterable[tuple[bytes, bytes]],
    edge: bytes,
    *,
    traced: bool = False,
) -> bytes:
    """The request line and the shared headers, then ``x-retry-edge: <edge>``, without the
    final blank line. One pass over ``headers``.

    ``tracestate`` goes with a valid ``traceparent`` only (W3C Trace Context section 4.2:
    without one it is discarded): when ``headers`` carry exactly one (the client's, passed
    through with tracing off) or ``traced`` (tracing on: each attempt adds its own), it is
    ``retry-sidecar=edge`` first (the newest member goes left; at most 32 members, dropped
    from the right), then the members ``headers`` carry; otherwise none is sent, and the
    edge marker travels in ``x-retry-edge`` alone."""
    parts = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    existing: bytes | None = None
    parents: list[bytes] = []
    for k, v in headers:
        if k == b"tracestate":
            existing = v
            continue
        if len(k) == 11 and k.lower() == TRACEPARENT:
            parents.append(v)
        parts.append(k + b": " + v + b"\r\n")
    parts.append(b"x-retry-edge: " + edge + b"\r\n")
    if traced or (len(parents) == 1 and valid_traceparent(parents[0])):
        if existing:
            members = (EDGE_MEMBER + b"," + existing).split(b",")
            value = b",".join(members[:MAX_TRACESTATE_MEMBERS])
        else:
            value = EDGE_MEMBER
        parts.append(b"tracestate: " + value + b"\r\n")
    return b"".join(parts)

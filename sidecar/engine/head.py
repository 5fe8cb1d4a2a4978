"""The request head every attempt of a sequence sends: the request line, the shared headers and
this sidecar's edge marker (also as the W3C ``tracestate`` member ``retry-sidecar=edge``)."""

from __future__ import annotations

from collections.abc import Iterable

TRACESTATE_KEY = b"retry-sidecar"
EDGE_MEMBER = TRACESTATE_KEY + b"=edge"
MAX_TRACESTATE_MEMBERS = 32  # W3C Trace Context: at most 32 list members


def edge_head(
    method: str, target: str, headers: Iterable[tuple[bytes, bytes]], edge: bytes
) -> bytes:
    """The request line and the shared headers, then ``x-retry-edge: <edge>`` and a tracestate
    with ``retry-sidecar=edge`` first (W3C: the newest member goes left; at most 32 members,
    dropped from the right), without the final blank line. One pass over ``headers``."""
    parts = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    existing: bytes | None = None
    for k, v in headers:
        if k == b"tracestate":
            existing = v
        else:
            parts.append(k + b": " + v + b"\r\n")
    parts.append(b"x-retry-edge: " + edge + b"\r\n")
    if existing:
        value = b",".join((EDGE_MEMBER + b"," + existing).split(b",")[:MAX_TRACESTATE_MEMBERS])
    else:
        value = EDGE_MEMBER
    parts.append(b"tracestate: " + value + b"\r\n")
    return b"".join(parts)

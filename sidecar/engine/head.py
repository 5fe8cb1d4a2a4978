"""The request head every attempt of a sequence sends: the request line, the shared headers and
this sidecar's edge marker (also as the W3C ``tracestate`` member ``retry-sidecar=edge``)."""

from __future__ import annotations

TRACESTATE_KEY = b"retry-sidecar"
EDGE_MEMBER = TRACESTATE_KEY + b"=edge"


def with_edge_tracestate(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Put ``retry-sidecar=edge`` first in tracestate (W3C: the newest member goes left)."""
    out = []
    existing: bytes | None = None
    for k, v in headers:
        if k == b"tracestate":
            existing = v
        else:
            out.append((k, v))
    value = EDGE_MEMBER if not existing else EDGE_MEMBER + b"," + existing
    # W3C allows at most 32 members; drop from the right.
    members = value.split(b",")[:32]
    out.append((b"tracestate", b",".join(members)))
    return out


def build_head(method: str, target: str, headers: list[tuple[bytes, bytes]]) -> bytes:
    """The request line and the shared headers, without the final blank line."""
    parts = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1")]
    for k, v in headers:
        parts.append(k + b": " + v + b"\r\n")
    return b"".join(parts)

"""HTTP/2 fields as the request path takes them, and back, as RFC 9113 section 8 says; and the
rate budgets an HTTP/2 connection is held to. Pure functions and a clock-injected bucket: no
I/O, no ``h2`` import (``proxy/h2conn.py`` feeds them what ``h2`` decoded).

A request's header list becomes a ``Mapped`` (method, target, the fields as the path reads them:
``:authority`` as ``Host`` first, then the regular fields in order, every ``cookie`` joined into
one with ``"; "``) or a ``Malformed`` with the reason: a stream error PROTOCOL_ERROR (RFC 9113
section 8.1.1). Malformed: a pseudo-header unknown, repeated, missing (``:method``, ``:scheme``,
``:path``), empty, or after a regular field; a ``:path`` not in origin-form (``*`` for OPTIONS); a
response pseudo-header; a name with an upper-case letter or outside a token; a value with NUL, CR
or LF or surrounding white space (an HTTP/1.1 upstream would read those as framing); a
connection-specific field (``connection``, ``keep-alive``, ``proxy-connection``,
``transfer-encoding``, ``upgrade``); ``te`` other than ``trailers``; a ``content-length`` that is
not digits, or two that differ. CONNECT is well-formed but not served here (``Mapped.connect``):
the front end refuses it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from multidict import CIMultiDict, CIMultiDictProxy

RawFields = list[tuple[bytes, bytes]]

PREFACE: Final = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# RFC 9113 section 8.2.2: these make a message malformed in HTTP/2.
CONNECTION_SPECIFIC: Final = frozenset(
    (b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade")
)
_REQUEST_PSEUDO: Final = frozenset((b":method", b":scheme", b":path", b":authority"))
# RFC 9110 section 5.6.2: tchar, lower case only (RFC 9113 section 8.2.1).
_TOKEN: Final = frozenset(b"!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")
_BAD_VALUE: Final = (b"\x00", b"\r", b"\n")


class Malformed:
    """Why a request's header list is malformed (a stream error PROTOCOL_ERROR)."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason: Final = reason


class Mapped:
    """A well-formed request head, as the path's ``ClientRequest`` takes it."""

    __slots__ = ("connect", "content_length", "fields", "method", "raw", "target")

    def __init__(
        self,
        method: str,
        target: str,
        raw: RawFields,
        content_length: int | None,
        *,
        connect: bool = False,
    ) -> None:
        self.method: Final = method
        self.target: Final = target
        self.raw: Final = raw
        self.content_length: Final = content_length
        self.connect: Final = connect
        self.fields: Final = CIMultiDictProxy(
            CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in raw)
        )


def _bad_name(name: bytes) -> bool:
    return not name or any(b not in _TOKEN for b in name)


def _bad_value(value: bytes) -> bool:
    if any(c in value for c in _BAD_VALUE):
        return True
    return value[:1] in (b" ", b"\t") or value[-1:] in (b" ", b"\t")


def map_request(headers: Iterable[tuple[bytes, bytes]]) -> Mapped | Malformed:
    """A request's decoded header list (names and values as bytes) mapped for the path."""
    pseudo: dict[bytes, bytes] = {}
    regular: RawFields = []
    cookies: list[bytes] = []
    lengths: set[bytes] = set()
    for name, value in headers:
        if name[:1] == b":":
            if regular:
                return Malformed(f"pseudo-header {name!r} after a regular field")
            if name not in _REQUEST_PSEUDO:
                return Malformed(f"pseudo-header {name!r} not a request's")
            if name in pseudo:
                return Malformed(f"pseudo-header {name!r} repeated")
            if _bad_value(value):
                return Malformed(f"invalid value of {name!r}")
            pseudo[name] = value
            continue
        if _bad_name(name):
            return Malformed(f"invalid field name {name!r}")
        if _bad_value(value):
            return Malformed(f"invalid value of field {name!r}")
        if name in CONNECTION_SPECIFIC:
            return Malformed(f"connection-specific field {name.decode()!r}")
        if name == b"te" and value != b"trailers":
            return Malformed("te other than trailers")
        if name == b"cookie":
            cookies.append(value)
            continue
        if name == b"content-length":
            lengths.add(value)
        if name == b"host" and pseudo.get(b":authority", value) != value:
            return Malformed("host differs from :authority")
        regular.append((name, value))
    method = pseudo.get(b":method")
    if not method:
        return Malformed("no :method")
    if _bad_name(method.lower()):
        return Malformed("invalid :method")
    authority = pseudo.get(b":authority")
    if method == b"CONNECT":
        return Mapped("CONNECT", (authority or b"").decode("latin-1"), regular, None, connect=True)
    path = pseudo.get(b":path")
    if not pseudo.get(b":scheme") or not path:
        return Malformed("no :scheme or :path")
    if path[:1] != b"/" and (path != b"*" or method != b"OPTIONS"):
        # RFC 9113 section 8.3.1: origin-form (or * for OPTIONS); an absolute-form target would
        # be read upstream for its authority, not ``:authority``'s.
        return Malformed(":path not origin-form")
    if len(lengths) > 1 or any(not v.isdigit() for v in lengths):
        return Malformed("invalid content-length")
    raw: RawFields = []
    if authority is not None:
        regular = [(k, v) for k, v in regular if k != b"host"]
        raw.append((b"host", authority))
    raw.extend(regular)
    if cookies:  # RFC 9113 section 8.2.3: one field for HTTP/1.1
        raw.append((b"cookie", b"; ".join(cookies)))
    length = int(next(iter(lengths))) if lengths else None
    return Mapped(method.decode("latin-1"), path.decode("latin-1"), raw, length)


def response_fields(status: int, fields: RawFields, own: RawFields) -> RawFields:
    """An answer's head as an HTTP/2 header list: ``:status`` first, names in lower case,
    connection-specific fields (and ``te``) dropped (RFC 9113 section 8.2.2)."""
    out: RawFields = [(b":status", b"%d" % status)]
    for part in (fields, own):
        for name, value in part:
            lname = name.lower()
            if lname in CONNECTION_SPECIFIC or lname == b"te":
                continue
            out.append((lname, value))
    return out


def trailer_fields(trailers: RawFields) -> RawFields:
    """Trailers as an HTTP/2 header list (no pseudo-headers, lower case, no
    connection-specific fields)."""
    return [
        (k.lower(), v)
        for k, v in trailers
        if k[:1] != b":" and k.lower() not in CONNECTION_SPECIFIC
    ]


class RateBudget:
    """A token bucket on an injected clock: ``take`` is False once more than ``burst`` events
    came faster than ``rate`` a second. What a connection's peer may do that costs the sidecar
    work it never asked for (streams it resets, control frames it sends) is held to one."""

    __slots__ = ("_at", "_burst", "_rate", "_tokens")

    def __init__(self, burst: float, rate: float, now: float) -> None:
        self._burst = burst
        self._rate = rate
        self._tokens = burst
        self._at = now

    def take(self, now: float, n: float = 1.0) -> bool:
        elapsed = max(0.0, now - self._at)
        self._at = now
        self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
        if self._tokens < n:
            return False
        self._tokens -= n
        return True

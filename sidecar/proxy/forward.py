"""Header rules for what goes upstream and what comes back. Pure, on raw (bytes) headers.

Hop-by-hop headers (RFC 9110 section 7.6.1) are dropped both ways, with every header that the
``Connection`` header names. The sidecar's own headers are added after filtering, so a client
cannot remove them by naming them in ``Connection``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from sidecar.engine.head import EDGE_MEMBER, TRACEPARENT, TRACESTATE_KEY, valid_traceparent

RawHeaders = Iterable[tuple[bytes, bytes]]

HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"proxy-connection",
        b"proxy-authenticate",
        b"proxy-authorization",
        # RFC 7540 section 3.2.1: a connection-specific field of an h2c upgrade, which the
        # sidecar never acts on (proxy/tunnel.py): dropped even when Connection omits it.
        b"http2-settings",
    }
)
# Re-framed by the sidecar itself, or handled by its server (100-continue).
REFRAMED = frozenset({b"content-length", b"expect"})
# The sidecar's own request headers: read only from trusted peers, always re-set.
OWN_REQUEST = frozenset({b"x-retry-attempt", b"x-retry-edge", b"x-request-timeout-ms"})
# Set only by this sidecar's own DLQ replays (which do not pass through here), so that an
# upstream can believe it: never passed on from any client, trusted peers included (an outer
# sidecar's replay marker names a record in that sidecar's DLQ, not in this one's).
REPLAY_MARKER = b"x-retry-replay"
# Envoy's X-Forwarded-Client-Cert: what a TLS listener learnt of the client's certificate. Only
# the sidecar may say that (a route's ``forward_client_cert``): never passed on from a client.
XFCC = b"x-forwarded-client-cert"
OWN_RESPONSE = frozenset(
    {
        b"x-retry-attempts",
        b"x-retry-fate",
        b"x-retry-proxy-error",
        b"x-retry-dlq",
        b"x-retry-dlq-id",
        b"x-retry-hedges",
    }
)
# RFC 9209: an end-to-end list to which each intermediary that handles a response adds its
# member (closest to the origin first), so it is relayed, unlike the hop-by-hop Proxy-*
# fields (Proxy-Connection, Proxy-Authenticate, Proxy-Authorization).
PROXY_STATUS = b"proxy-status"
# Never removed because ``Connection`` names them: without Host an HTTP/1.1 request is
# invalid (RFC 9112 section 3.2), and Content-Length frames the relayed body.
PROTECTED = frozenset({b"host", b"content-length"})


def connection_named(headers: RawHeaders) -> frozenset[bytes]:
    names: set[bytes] = set()
    for k, v in headers:
        if k.lower() == b"connection":
            for token in v.split(b","):
                t = token.strip().lower()
                if t and t not in PROTECTED:
                    names.add(t)
    return frozenset(names)


def _is_hop(lname: bytes, named: frozenset[bytes]) -> bool:
    return lname in HOP_BY_HOP or lname in named or lname.startswith(b"proxy-")


def request_headers(
    raw: Iterable[tuple[bytes, bytes]],
    peer: str,
    trusted: bool,
    scheme: bytes = b"http",
    *,
    default_host: bytes | None = None,
    authority: bytes | None = None,
    tls_host: bytes | None = None,
) -> tuple[list[tuple[bytes, bytes]], bytes | None, bytes | None]:
    """Headers to send upstream (minus per-attempt ones), plus the trusted edge marker and
    propagated timeout (None when absent or the peer is not trusted).

    ``authority`` is the host of an absolute-form request target: it replaces any received
    Host (RFC 9112 section 3.2.2). ``tls_host``: the name an ``https://`` upstream is verified
    by (and sent as SNI); it is the Host sent, whatever the client's was, as nginx's
    ``proxy_pass https://`` sends its upstream's name: a TLS server that routes by name answers
    421 to a Host its SNI does not match. The client's Host then goes in X-Forwarded-Host.

    X-Forwarded-For keeps what the client sent and appends the real peer; X-Forwarded-Proto
    (``scheme``: https for a request that came over the TLS listener, as nginx's ``$scheme``)
    and X-Forwarded-Host are set by the sidecar (kept from a trusted peer).
    X-Forwarded-Client-Cert is never passed on (the caller adds its own where a route asks).

    One pass over the received headers: the names a ``Connection`` header lists are only known
    once it has been read, so they are removed afterwards, and only when it names a field that
    is not hop-by-hop already (``Connection: keep-alive`` does not; ``close`` or a custom name
    does, and costs a second pass over what was kept).
    """
    out: list[tuple[bytes, bytes]] = []
    xff: list[bytes] = []
    edge: bytes | None = None
    timeout: bytes | None = None
    host: bytes | None = None
    proto: bytes | None = None
    fwd_host: bytes | None = None
    tracestate: list[bytes] = []
    traceparent: list[bytes] = []
    named: list[bytes] | None = None  # the Connection header values, rarely more than one
    for k, v in raw:
        lk = k.lower()
        if lk in OWN_REQUEST:
            if trusted:
                if lk == b"x-retry-edge":
                    edge = v
                elif lk == b"x-request-timeout-ms":
                    timeout = v if timeout is None else timeout + b"," + v  # the smallest wins
            continue
        if lk in (REPLAY_MARKER, XFCC):
            continue
        if lk == b"tracestate":
            tracestate.append(v)
            continue
        if lk == TRACEPARENT:
            traceparent.append(v)  # and passed on as it came
        if lk == b"x-forwarded-for":
            xff.append(v)
            continue
        if lk == b"x-forwarded-proto":
            if trusted:
                proto = v
            continue
        if lk == b"x-forwarded-host":
            if trusted:
                fwd_host = v
            continue
        if lk == b"host":
            if host is not None:
                continue  # only one Host goes upstream (the server refuses two anyway)
            if authority is not None:
                v = authority  # in place, so the field keeps its position
            host = v
            out.append((k, tls_host or v))
            continue
        if lk == b"connection":
            if named is None:
                named = []
            named.append(v)
            continue
        if lk in REFRAMED or _is_hop(lk, _NOTHING):
            continue
        out.append((k, v))
    if named is not None:
        out = _drop_named(out, named)
    if tracestate:
        if (
            trusted
            and edge is None
            and any(m.strip() == EDGE_MEMBER for m in _split_tracestate(tracestate))
        ):
            edge = b"tracestate"
        # W3C Trace Context section 4.2: a tracestate belongs to its traceparent; without
        # one valid traceparent it is discarded, never sent upstream on its own.
        if len(traceparent) == 1 and valid_traceparent(traceparent[0]):
            members = [
                m for m in _split_tracestate(tracestate) if not m.startswith(TRACESTATE_KEY + b"=")
            ]
            if members:
                out.append((b"tracestate", b",".join(members)))
    xff.append(peer.encode("ascii", "replace"))
    out.append((b"X-Forwarded-For", b", ".join(xff)))
    out.append((b"X-Forwarded-Proto", proto or scheme))
    if authority is not None and host is None:
        host = authority
        out.append((b"Host", tls_host or authority))
    if fwd_host or host:
        out.append((b"X-Forwarded-Host", fwd_host or host or b""))
    if host is None and (tls_host or default_host) is not None:
        # An HTTP/1.0 client may send no Host; HTTP/1.1 upstreams require one.
        out.append((b"Host", tls_host or default_host or b""))
    return out, edge, timeout


_NOTHING: frozenset[bytes] = frozenset()


def _drop_named(
    kept: list[tuple[bytes, bytes]], connection_values: list[bytes]
) -> list[tuple[bytes, bytes]]:
    """``kept`` without the fields the Connection header values name (hop-by-hop ones are
    gone already; Host and Content-Length are never removed)."""
    if len(connection_values) == 1 and connection_values[0].lower() == b"keep-alive":
        return kept  # what nginx and most upstreams send: it names nothing left to drop
    names = connection_named((b"connection", v) for v in connection_values) - HOP_BY_HOP
    if not names:
        return kept
    return [(k, v) for k, v in kept if k.lower() not in names]


def _split_tracestate(values: list[bytes]) -> list[bytes]:
    out = []
    for v in values:
        for m in v.split(b","):
            m = m.strip()
            if m:
                out.append(m)
    return out


def response_headers(raw: Iterable[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    """Upstream response headers to copy to the client, as the bytes that came (obs-text
    included: nginx and Envoy copy bytes, they do not re-encode). One pass, as for requests:
    a Connection header naming more than hop-by-hop fields costs a second one."""
    out = []
    named: list[bytes] | None = None
    for k, v in raw:
        lk = k.lower()
        if lk == b"connection":
            if named is None:
                named = []
            named.append(v)
        elif lk == PROXY_STATUS or not (_is_hop(lk, _NOTHING) or lk in OWN_RESPONSE):
            out.append((k, v))
    if named is not None:
        out = _drop_named(out, named)
    return out


# RFC 3986 section 3.2.2: uri-host (reg-name of unreserved, sub-delims and pct-encoded, or an
# IP-literal) and an optional port.
_HOST = re.compile(
    rb"(?:[A-Za-z0-9\-._~!$&'()*+,;=%]*|\[[0-9A-Fa-f:.vV\-._~!$&'()*+,;=]*\])(?::[0-9]*)?"
)
_HOST_CACHE: dict[bytes, bool] = {}


def valid_host(value: bytes) -> bool:
    """A Host field value RFC 9112 section 3.2 accepts: uri-host [ ":" port ]. Values such as
    ``good evil`` or ``evil/x?y`` are refused with 400 (as nginx does), never forwarded.
    Cached: a sidecar sees the same few Host values over and over."""
    hit = _HOST_CACHE.get(value)
    if hit is None:
        hit = _HOST.fullmatch(value) is not None
        if len(_HOST_CACHE) >= 1024:
            _HOST_CACHE.clear()
        _HOST_CACHE[value] = hit
    return hit

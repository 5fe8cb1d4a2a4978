"""Hypothesis properties over header handling and routing."""

from __future__ import annotations

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.config.model import Match
from sidecar.config.parse import parse_text
from sidecar.engine import head
from sidecar.proxy import forward
from sidecar.proxy.routing import find_route, matches

TOKEN = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-ABCXYZ0123456789", min_size=1, max_size=12)
SPECIAL = st.sampled_from(
    [
        "connection",
        "keep-alive",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "proxy-authorization",
        "proxy-status",
        "x-retry-edge",
        "x-retry-attempt",
        "x-request-timeout-ms",
        "x-forwarded-for",
        "tracestate",
        "traceparent",
        "host",
        "content-length",
        "expect",
        "idempotency-key",
    ]
)
NAME = st.one_of(TOKEN, SPECIAL)
VALUE = st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=30)
HEADERS = st.lists(st.tuples(NAME, VALUE), max_size=15).map(
    lambda hs: [(k.encode(), v.encode()) for k, v in hs]
)


@settings(max_examples=300)
@given(HEADERS, st.booleans())
def test_request_headers_never_leak_hop_by_hop_or_spoofed_retry_headers(raw, trusted):
    out, edge, timeout = forward.request_headers(raw, "10.0.0.9", trusted)
    named = forward.connection_named(raw)
    names = [k.lower() for k, _ in out]
    for n in names:
        assert n not in forward.HOP_BY_HOP
        assert n not in forward.OWN_REQUEST
        assert n not in forward.REFRAMED
        if n not in (b"x-forwarded-for", b"x-forwarded-proto", b"x-forwarded-host", b"tracestate"):
            assert n not in named
    xff = [v for k, v in out if k == b"X-Forwarded-For"]
    assert len(xff) == 1 and xff[0].endswith(b"10.0.0.9")
    ts = [v for k, v in out if k == b"tracestate"]
    assert not any(b"retry-sidecar=" in v for v in ts)
    if not trusted:
        assert edge is None and timeout is None


@settings(max_examples=300)
@given(HEADERS)
def test_response_headers_drop_hop_by_hop_and_connection_named(raw):
    out = forward.response_headers(raw)
    named = forward.connection_named(raw)
    for k, _ in out:
        lk = k.lower()
        assert lk not in forward.HOP_BY_HOP and lk not in named
        assert lk == b"proxy-status" or not lk.startswith(b"proxy-")  # RFC 9209: end to end
        assert lk not in forward.OWN_RESPONSE
    # Bytes are copied as they came (obs-text included), in their order.
    kept = [(k, v) for k, v in raw if (k, v) in out]
    assert kept == out


VALID_PARENT = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@settings(max_examples=200)
@given(HEADERS, st.sampled_from([b"edge-a", b"outer"]), st.booleans(), st.integers(0, 2))
def test_edge_head_puts_the_edge_member_first_once_with_a_traceparent(raw, edge, traced, parents):
    """The tracestate (edge member first) goes only with a traceparent: one valid in the
    headers, or ``traced`` (the attempt adds its own); never alone (W3C section 4.2)."""
    raw = raw + [(b"traceparent", VALID_PARENT)] * parents
    head_bytes = head.edge_head("GET", "/p", raw, edge, traced=traced)
    lines = head_bytes.split(b"\r\n")
    assert lines[0] == b"GET /p HTTP/1.1" and lines[-1] == b""
    fields = [tuple(line.split(b": ", 1)) for line in lines[1:-1]]
    ts = [v for k, v in fields if k == b"tracestate"]
    # Every other field goes out as it came, in its order, then the edge marker.
    sent = [v for k, v in raw if k.lower() == b"traceparent"]
    if traced or (len(sent) == 1 and head.valid_traceparent(sent[0])):
        assert len(ts) == 1 and ts[0].startswith(head.EDGE_MEMBER)
        assert len(ts[0].split(b",")) <= head.MAX_TRACESTATE_MEMBERS
        assert fields[-2] == (b"x-retry-edge", edge)
        assert fields[:-2] == [(k, v) for k, v in raw if k != b"tracestate"]
    else:
        assert ts == []
        assert fields[-1] == (b"x-retry-edge", edge)
        assert fields[:-1] == [(k, v) for k, v in raw if k != b"tracestate"]


def test_valid_traceparent():
    assert head.valid_traceparent(VALID_PARENT)
    assert head.valid_traceparent(b"01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x")
    for bad in (
        b"",
        b"ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-x",
        b"00-" + b"0" * 32 + b"-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319c-" + b"0" * 16 + b"-01",
        b"00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
        b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-1",
    ):
        assert not head.valid_traceparent(bad), bad


def _request_headers_two_passes(raw, peer, trusted):
    """The plain form of forward.request_headers (Connection-named fields found first, then
    one filtering pass), kept here as the oracle for its one-pass form."""
    named = forward.connection_named(raw)
    out, xff, ts, parents = [], [], [], []
    edge = host = proto = fwd_host = None
    timeouts: list[bytes] = []
    for k, v in raw:
        lk = k.lower()
        if lk in forward.OWN_REQUEST:
            if trusted and lk == b"x-retry-edge":
                edge = v
            elif trusted and lk == b"x-request-timeout-ms":
                timeouts.append(v)  # all kept, comma-joined: the smallest is the bound
        elif lk == forward.REPLAY_MARKER:
            pass
        elif lk == b"tracestate":
            ts.append(v)
        elif lk == b"x-forwarded-for":
            xff.append(v)
        elif lk == b"traceparent":
            parents.append(v)  # counted even when Connection names it (then not sent)
            if lk not in named:
                out.append((k, v))
        elif lk == b"x-forwarded-proto":
            proto = v if trusted else proto
        elif lk == b"x-forwarded-host":
            fwd_host = v if trusted else fwd_host
        elif lk == b"host":
            if host is None:
                host = v
                out.append((k, v))
        elif not (
            lk in forward.REFRAMED
            or lk in forward.HOP_BY_HOP
            or lk in named
            or lk.startswith(b"proxy-")
        ):
            out.append((k, v))
    members = [m.strip() for v in ts for m in v.split(b",") if m.strip()]
    if trusted and edge is None and head.EDGE_MEMBER in members:
        edge = b"tracestate"
    members = [m for m in members if not m.startswith(head.TRACESTATE_KEY + b"=")]
    if members and len(parents) == 1 and head.valid_traceparent(parents[0]):
        out.append((b"tracestate", b",".join(members)))
    out.append((b"X-Forwarded-For", b", ".join([*xff, peer.encode()])))
    out.append((b"X-Forwarded-Proto", proto or b"http"))
    if fwd_host or host:
        out.append((b"X-Forwarded-Host", fwd_host or host))
    timeout = b",".join(timeouts) if timeouts else None
    return out, edge, timeout


@settings(max_examples=400)
@given(HEADERS, st.booleans(), st.integers(0, 2))
def test_one_pass_request_headers_equal_the_two_pass_form(raw, trusted, parents):
    raw = raw + [(b"traceparent", VALID_PARENT)] * parents
    assert forward.request_headers(raw, "10.0.0.9", trusted) == _request_headers_two_passes(
        raw, "10.0.0.9", trusted
    )


@settings(max_examples=400)
@given(HEADERS)
def test_one_pass_response_headers_equal_the_two_pass_form(raw):
    named = forward.connection_named(raw)
    plain = [
        (k, v)
        for k, v in raw
        if not (
            k.lower() in forward.HOP_BY_HOP
            or k.lower() in named
            or (k.lower().startswith(b"proxy-") and k.lower() != b"proxy-status")
            or k.lower() in forward.OWN_RESPONSE
        )
    ]
    assert forward.response_headers(raw) == plain


ROUTES = parse_text(
    """
version: 1
routes:
  - {name: exact, upstream: "http://h:1", match: {path: /exact}}
  - {name: posts, upstream: "http://h:1", match: {path_prefix: /api, methods: [POST]}}
  - {name: regex, upstream: "http://h:1", match: {path_regex: "/v[0-9]+/.*"}}
  - {name: tenant, upstream: "http://h:1", match: {headers: {x-tenant: acme}}}
  - {name: api, upstream: "http://h:1", match: {path_prefix: /api}}
"""
).routes
PATH = st.one_of(
    st.sampled_from(["/exact", "/api", "/api/x", "/v1/a", "/v12/", "/v/x", "/", "/exactly"]),
    st.text(alphabet="/abcv0123%", max_size=12).map(lambda s: "/" + s),
)


@settings(max_examples=400)
@given(PATH, st.sampled_from(["GET", "POST", "PUT"]), st.sampled_from([None, "acme", "other"]))
def test_first_match_wins_and_agrees_with_a_reference(path, method, tenant):
    def header(name: str) -> str | None:
        return tenant if name == "x-tenant" else None

    def reference(m: Match) -> bool:
        if m.methods is not None and method not in m.methods:
            return False
        if m.path is not None and path != m.path:
            return False
        if m.path_prefix is not None and not path.startswith(m.path_prefix):
            return False
        if m.path_regex is not None and not re.fullmatch(m.path_regex.pattern, path):
            return False
        return all(header(n) == v for n, v in m.headers)

    got = find_route(ROUTES, method, path, header)
    expected = next((r for r in ROUTES if reference(r.match)), None)
    assert got is expected
    if got is not None:
        assert matches(got.match, method, path, header)

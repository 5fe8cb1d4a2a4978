"""The HTTP/2 front end's pure parts (``proxy/h2fields.py``): a request's header list mapped as
RFC 9113 section 8 says, an answer's head as a header list, and the rate budget on a fake
clock."""

from __future__ import annotations

import pytest

from sidecar.proxy.h2fields import (
    Malformed,
    Mapped,
    RateBudget,
    map_request,
    response_fields,
    trailer_fields,
)

BASE = [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"/p?q=1")]
AUTH = [(b":authority", b"svc.test:8080")]


def test_a_request_mapped_authority_as_host_first_cookies_joined() -> None:
    got = map_request(
        [
            *BASE,
            *AUTH,
            (b"cookie", b"a=1"),
            (b"x-one", b"1"),
            (b"cookie", b"b=2"),
            (b"te", b"trailers"),
            (b"content-length", b"5"),
        ]
    )
    assert isinstance(got, Mapped)
    assert (got.method, got.target, got.content_length) == ("GET", "/p?q=1", 5)
    assert got.raw == [
        (b"host", b"svc.test:8080"),
        (b"x-one", b"1"),
        (b"te", b"trailers"),
        (b"content-length", b"5"),
        (b"cookie", b"a=1; b=2"),
    ]
    assert got.fields["Host"] == "svc.test:8080"


def test_a_host_field_without_authority_is_kept_and_one_equal_to_it_is_not_doubled() -> None:
    only_host = map_request([*BASE, (b"host", b"h.test")])
    assert isinstance(only_host, Mapped) and only_host.raw == [(b"host", b"h.test")]
    both = map_request([*BASE, (b":authority", b"h.test"), (b"host", b"h.test")])
    assert isinstance(both, Mapped) and both.raw == [(b"host", b"h.test")]


MALFORMED = [
    ([*BASE, (b"connection", b"close")], "connection-specific"),
    ([*BASE, (b"keep-alive", b"5")], "connection-specific"),
    ([*BASE, (b"proxy-connection", b"x")], "connection-specific"),
    ([*BASE, (b"transfer-encoding", b"chunked")], "connection-specific"),
    ([*BASE, (b"upgrade", b"h2c")], "connection-specific"),
    ([*BASE, (b"te", b"gzip")], "te"),
    ([*BASE, (b"X-Upper", b"1")], "name"),
    ([*BASE, (b"x-a", b"1\r\nx-b: 2")], "value"),
    ([*BASE, (b"x-a", b"nul\x00")], "value"),
    ([*BASE, (b"x-a", b" lead")], "value"),
    ([*BASE, (b"x-a", b"trail\t")], "value"),
    ([*BASE, (b"content-length", b"1x")], "content-length"),
    ([*BASE, (b"content-length", b"1"), (b"content-length", b"2")], "content-length"),
    ([(b"x-a", b"1"), *BASE], "after a regular field"),
    ([*BASE, (b":status", b"200")], "not a request's"),
    ([*BASE, (b":path", b"/again")], "repeated"),
    ([(b":scheme", b"http"), (b":path", b"/")], "no :method"),
    ([(b":method", b"GET"), (b":path", b"/")], "no :scheme"),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"")], "no :scheme or :path"),
    ([(b":method", b"G T"), (b":scheme", b"http"), (b":path", b"/")], "invalid :method"),
    ([*BASE, *AUTH, (b"host", b"other.test")], "host differs"),
    (
        [(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"http://evil.test/")],
        "origin-form",
    ),
    ([(b":method", b"GET"), (b":scheme", b"http"), (b":path", b"*")], "origin-form"),
]


@pytest.mark.parametrize(("headers", "why"), MALFORMED)
def test_malformed_requests_are_refused_with_their_reason(
    headers: list[tuple[bytes, bytes]], why: str
) -> None:
    got = map_request(headers)
    assert isinstance(got, Malformed), headers
    assert why in got.reason


def test_connect_is_well_formed_and_marked() -> None:
    got = map_request([(b":method", b"CONNECT"), (b":authority", b"db.test:5432")])
    assert isinstance(got, Mapped) and got.connect and got.target == "db.test:5432"


def test_an_answer_as_a_header_list() -> None:
    fields = [(b"Content-Type", b"text/plain"), (b"Connection", b"close"), (b"Keep-Alive", b"5")]
    own = [(b"x-retry-attempts", b"2"), (b"Transfer-Encoding", b"chunked")]
    assert response_fields(503, fields, own) == [
        (b":status", b"503"),
        (b"content-type", b"text/plain"),
        (b"x-retry-attempts", b"2"),
    ]
    assert trailer_fields([(b"Grpc-Status", b"0"), (b":status", b"1"), (b"upgrade", b"x")]) == [
        (b"grpc-status", b"0")
    ]


def test_the_rate_budget_allows_a_burst_then_its_rate() -> None:
    budget = RateBudget(burst=3, rate=2.0, now=100.0)
    assert [budget.take(100.0) for _ in range(4)] == [True, True, True, False]
    assert budget.take(100.4) is False  # 0.8 of a token back
    assert budget.take(100.5) is True  # one whole token back at 2 a second
    assert budget.take(200.0) and budget.take(200.0) and budget.take(200.0)  # refilled, capped
    assert budget.take(200.0) is False
    assert budget.take(99.0) is False  # a clock that went back gives nothing

"""Pure HTTP rules: the upstream connection's state machine, request targets, Host values."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sidecar.proxy.forward import request_headers, valid_host
from sidecar.proxy.routing import Refused, Target, request_target
from sidecar.upstream.states import ConnState, IllegalConnTransition, Link, Req, Resp


def test_a_clean_exchange_makes_the_connection_reusable():
    s = ConnState()
    s.begin()
    assert (s.req, s.resp, s.link) == (Req.SENDING, Resp.AWAITING_HEAD, Link.OPEN)
    s.request(Req.SENT)
    s.response(Resp.BODY)
    assert not s.reusable
    s.response(Resp.DONE)
    assert s.reusable
    s.next_exchange()
    s.begin()


def test_an_early_answer_is_never_reused():
    s = ConnState()
    s.begin()
    s.response(Resp.BODY)  # the head arrived while the request body was still being sent
    s.response(Resp.DONE)
    s.request(Req.ABANDONED)
    s.to_link(Link.MUST_CLOSE)
    assert not s.reusable
    with pytest.raises(IllegalConnTransition):
        s.next_exchange()


def test_extra_data_after_a_complete_response_means_must_close():
    s = ConnState()
    s.begin()
    s.request(Req.SENT)
    s.response(Resp.DONE)
    s.to_link(Link.MUST_CLOSE)
    assert not s.reusable
    s.to_link(Link.BROKEN)
    s.to_link(Link.CLOSED)
    s.to_link(Link.CLOSED)  # closing twice is fine
    assert s.link is Link.CLOSED


@pytest.mark.parametrize(
    "move",
    [
        lambda s: s.request(Req.SENT),  # nothing was being sent
        lambda s: s.response(Resp.BODY),  # no exchange began
        lambda s: (s.begin(), s.begin()),  # two exchanges at once
        lambda s: (s.begin(), s.response(Resp.DONE), s.response(Resp.BODY)),  # body after end
        lambda s: (s.begin(), s.request(Req.SENT), s.request(Req.SENDING)),
        lambda s: (s.to_link(Link.CLOSED), s.to_link(Link.OPEN)),  # reopening
        lambda s: (s.to_link(Link.CLOSED), s.begin()),  # sending on a closed connection
        lambda s: (s.to_link(Link.MUST_CLOSE), s.begin()),
        lambda s: s.next_exchange(),
    ],
)
def test_illegal_moves_raise(move):
    with pytest.raises(IllegalConnTransition):
        move(ConnState())


@pytest.mark.parametrize(
    ("method", "raw", "host", "want"),
    [
        ("GET", "/a/b?q=1", "h", Target("/a/b", "/a/b?q=1")),
        ("GET", "http://up.example/a?q", "x", Target("/a", "/a?q", "up.example")),
        ("GET", "HTTP://up.example:8080", None, Target("/", "/", "up.example:8080")),
        ("GET", "http://up.example?q=1", "x", Target("/", "/?q=1", "up.example")),
        ("POST", "https://[::1]:8443/p", "x", Target("/p", "/p", "[::1]:8443")),
    ],
)
def test_request_targets(method, raw, host, want):
    assert request_target(method, raw, host) == want


@pytest.mark.parametrize(
    ("method", "raw", "host"),
    [
        ("CONNECT", "example.com:443", "example.com:443"),
        ("OPTIONS", "*", "h"),
        ("OPTIONS", "http://h", "h"),
        ("GET", "http://user:pw@h/x", "h"),
        ("GET", "ftp://h/x", "h"),
        ("GET", "http:///x", "h"),
        ("GET", "/x", "good evil"),
        ("GET", "/x", "evil/x?y"),
        ("GET", "/x", "h:port"),
        ("GET", "x", "h"),
    ],
)
def test_refused_targets_and_hosts(method, raw, host):
    assert isinstance(request_target(method, raw, host), Refused)


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        (b"example.com", True),
        (b"example.com:8080", True),
        (b"example.com:", True),
        (b"127.0.0.1:1", True),
        (b"[::1]:80", True),
        (b"xn--bcher-kva.example", True),
        (b"", True),
        (b"good evil", False),
        (b"evil/x?y", False),
        (b"a@b", False),
        (b"[::1", False),
        (b"h:80:80", False),
        (b"h\xc3\xbc", False),
    ],
)
def test_host_values(value, ok):
    assert valid_host(value) is ok


@settings(max_examples=200)
@given(st.sampled_from([b"host", b"Host", b"content-length", b"HOST, close"]))
def test_connection_cannot_remove_host(option):
    out, _, _ = request_headers(
        [(b"Host", b"app"), (b"Connection", option)], "10.0.0.1", trusted=False
    )
    assert [v for k, v in out if k == b"Host"] == [b"app"]


def test_absolute_form_authority_replaces_host_in_place():
    out, _, _ = request_headers(
        [(b"Accept", b"*/*"), (b"Host", b"spoofed"), (b"X-A", b"1")],
        "10.0.0.1",
        trusted=False,
        authority=b"real.example",
    )
    assert out[:3] == [(b"Accept", b"*/*"), (b"Host", b"real.example"), (b"X-A", b"1")]
    assert (b"X-Forwarded-Host", b"real.example") in out

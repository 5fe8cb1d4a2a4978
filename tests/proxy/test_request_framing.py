"""The request framing of a client connection (``sidecar/proxy/framing.py``): how much of each
read goes to aiohttp's parser before the server looks at what it made of it. Pure: a model
parser stands in for llhttp, and the byte stream is cut at every position and at random."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from sidecar.proxy.framing import (
    RequestFraming,
    blank_line_end,
    escape_request_line,
    target_of,
)


def test_a_blank_line_is_found_across_reads_and_with_bare_line_feeds():
    assert blank_line_end(b"", b"GET / HTTP/1.1\r\nHost: a\r\n\r\nbody") == 27
    assert blank_line_end(b"", b"GET / HTTP/1.1\nHost: a\n\nbody") == 24
    assert blank_line_end(b"\r\n", b"\r\nbody") == 2  # split after the first CRLF
    assert blank_line_end(b"\n\r", b"\nbody") == 1
    assert blank_line_end(b"a\n", b"\nbody") == 1
    assert blank_line_end(b"\r\n\r\n", b"body") == -1  # ended in the bytes before: not here
    assert blank_line_end(b"", b"no blank line\r\n") == -1


@dataclass(frozen=True)
class Msg:
    head: bytes
    body: bytes  # as framed on the wire
    length: int
    chunked: bool
    closes: bool

    @property
    def wire(self) -> bytes:
        return self.head + self.body


def _msg(body: bytes, chunked: bool, closes: bool) -> Msg:
    head = b"PUT /x HTTP/1.1\r\nHost: a\r\n" + (b"Connection: close\r\n" if closes else b"")
    if chunked:
        framed = b"%x\r\n%b\r\n0\r\n\r\n" % (len(body), body) if body else b"0\r\n\r\n"
        return Msg(head + b"Transfer-Encoding: chunked\r\n\r\n", framed, 0, True, closes)
    return Msg(head + b"Content-Length: %d\r\n\r\n" % len(body), body, len(body), False, closes)


def _feed_all(stream: bytes, msgs: list[Msg], reads: list[bytes]) -> bytes:
    """Run the framing over ``reads`` with a model parser that knows where each message ends
    (as llhttp does): returns the bytes handed to the parser. Checks that every head and
    every chunked body ends exactly at the end of a piece, as the server needs."""
    framing = RequestFraming()
    fed = b""
    ends = []  # (position where the head ends, position where the message ends)
    pos = 0
    for m in msgs:
        ends.append((pos + len(m.head), pos + len(m.wire)))
        pos += len(m.wire)
    heads = {h: m for (h, _), m in zip(ends, msgs, strict=True)}
    chunk_ends = {e for (_, e), m in zip(ends, msgs, strict=True) if m.chunked}
    for data in reads:
        while data:
            n = framing.take(data)
            if n == 0:
                break
            piece, data = data[:n], data[n:]
            before = len(fed)
            fed += piece
            framing.fed(piece)
            for h, m in heads.items():
                assert not before < h < len(fed), "a head ended inside a piece"
                if h == len(fed):
                    framing.head(m.length, m.chunked, m.closes)
            for e in chunk_ends:
                assert not before < e < len(fed), "a chunked body ended inside a piece"
                if e == len(fed):
                    framing.body_ended()
    return fed


BODY = b"\r\n\r\n0\r\n\r\nGET / HTTP/1.1\r\n\r\n" + bytes(range(256))


@pytest.mark.parametrize("chunked", [False, True])
def test_a_request_that_closes_is_parsed_whole_at_every_split_and_nothing_after_it(chunked):
    first = _msg(b"keep", chunked=False, closes=False)
    closing = _msg(BODY, chunked=chunked, closes=True)
    after = b"GET /after HTTP/1.1\r\nHost: a\r\n\r\n"
    stream = first.wire + closing.wire + after
    want = first.wire + closing.wire
    for cut in range(1, len(stream)):
        assert _feed_all(stream, [first, closing], [stream[:cut], stream[cut:]]) == want, cut
    rng = random.Random(7)
    for _ in range(300):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randrange(1, 20)))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        assert _feed_all(stream, [first, closing], reads) == want
    one_by_one = [stream[i : i + 1] for i in range(len(stream))]
    assert _feed_all(stream, [first, closing], one_by_one) == want


def test_keep_alive_requests_all_reach_the_parser():
    msgs = [_msg(BODY, chunked=c, closes=False) for c in (False, True, False)]
    stream = b"".join(m.wire for m in msgs)
    rng = random.Random(3)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(stream)), rng.randrange(1, 30)))
        reads = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        assert _feed_all(stream, msgs, reads) == stream


def test_a_refused_request_ends_the_parsing():
    framing = RequestFraming()
    assert framing.take(b"GET / HTTP/9.9\r\n\r\nGET /") == 18
    framing.fed(b"GET / HTTP/9.9\r\n\r\n")
    framing.refused()
    assert framing.take(b"GET /") == 0


def test_bytes_over_0x7f_of_a_request_line_are_escaped_for_the_parser_only():
    line = b"GET /caf\xc3\xa9?y=\xff HTTP/1.1\r\n"
    rest = b"Host: \xc3\xbc\r\n\r\n"  # header bytes stay as they are (obs-text)
    whole, seen, done = escape_request_line(line + rest, b"")
    assert whole == b"GET /caf%C3%A9?y=%FF HTTP/1.1\r\n" + rest and done
    assert target_of(seen) == b"/caf\xc3\xa9?y=\xff"
    # One byte at a time, a multi-byte character cut in two included.
    out, seen, done = b"", b"", False
    for i in range(len(line)):
        assert not done
        piece, seen, done = escape_request_line(line[i : i + 1], seen)
        out += piece
    assert out == b"GET /caf%C3%A9?y=%FF HTTP/1.1\r\n" and done
    assert target_of(seen) == b"/caf\xc3\xa9?y=\xff"
    # Empty lines before a request line are passed over (RFC 9112 section 2.2).
    piece, seen, done = escape_request_line(b"\r\n\r\nGET /\xc3\xbc HTTP/1.1\r\n", b"")
    assert piece == b"\r\n\r\nGET /%C3%BC HTTP/1.1\r\n" and target_of(seen) == b"/\xc3\xbc"
    assert target_of(b"GET /a b HTTP/1.1") is None  # not a request line: the parser refuses it


def test_the_request_line_is_known_again_after_each_request():
    framing = RequestFraming()
    assert framing.in_request_line
    framing.line_done = True
    framing.head(3, chunked=False, closes=False)
    assert not framing.in_request_line  # in the body
    framing.fed(b"abc")
    assert framing.in_request_line  # the next request starts
    framing.line_done = True
    framing.head(0, chunked=True, closes=False)
    assert not framing.in_request_line
    framing.body_ended()
    assert framing.in_request_line

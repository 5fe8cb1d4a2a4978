"""Where the bytes of one client connection belong: which request's head, which body, or
nothing (after a request that closes the connection). Pure: no I/O, no parser.

aiohttp's C parser (llhttp) is strict about one thing the proxy must not be: a byte after the
end of a request that closes the connection (``Connection: close``, HTTP/1.0 without
keep-alive) makes it refuse the whole read it came in, the request included ("Data after
`Connection: close`"). RFC 9112 section 9.6 only asks a server not to process further
requests there. So the server never hands the parser more than one request at a time: this
class says how many bytes of a read may go to the parser before the server must look at what
the parser made of them, and what to ignore.

- Outside a body of known length, bytes go up to the end of the next blank line (``\\n\\n``
  or ``\\n\\r\\n``): a request head ends there, and so does a chunked body (its last chunk
  and trailer section end in an empty line). Cutting at other blank lines too (in a chunked
  body's data) costs a parser call, nothing else.
- A body of known length (Content-Length) goes up to its last byte, however many reads it
  takes: a read may end anywhere in it.
- After a request that closes the connection has ended, or one the server refused (400,
  431...), nothing more is parsed.

llhttp also refuses raw bytes over 0x7F in a request target (``GET /f?y=ü`` as curl sends it),
which nginx and gunicorn accept and pass on. The bytes of a request line are therefore known
here (``in_request_line``) and escaped for the parser only (``escape_request_line``); the
server puts the target back as it came before the handler sees it.
"""

from __future__ import annotations


def blank_line_end(before: bytes, data: bytes) -> int:
    """The length of the shortest prefix of ``data`` that ends with a blank line, ``before``
    being the bytes that came just before it (its last two are enough); -1 when there is none.
    A blank line ends with ``\\n`` after ``\\n`` or after ``\\n\\r`` (llhttp takes a bare LF as a
    line end)."""
    joined = before[-2:] + data
    shift = len(joined) - len(data)
    best = -1
    for mark in (b"\n\n", b"\n\r\n"):
        i = joined.find(mark)
        while i >= 0 and i + len(mark) - shift <= 0:  # ends in ``before``: not a cut of ``data``
            i = joined.find(mark, i + 1)
        if i >= 0:
            end = i + len(mark) - shift
            best = end if best < 0 else min(best, end)
    return best


class RequestFraming:
    """The position in a client connection's byte stream. ``take`` says how much to feed the
    parser next; ``fed`` reports it was fed; ``head``, ``refused`` and ``body_ended`` report
    what the parser made of it."""

    __slots__ = (
        "_body_left",
        "_chunked",
        "_close_after",
        "_tail",
        "closed",
        "line_done",
        "passthrough",
    )

    def __init__(self) -> None:
        self._body_left = 0  # bytes of a Content-Length body still to come
        self._close_after = False  # the current request closes the connection when it ends
        self._tail = b""  # the last bytes fed, to see a blank line split between two reads
        self.closed = False  # nothing more is parsed on this connection
        self.passthrough = False  # an Upgrade request: aiohttp keeps the rest itself
        self._chunked = False  # in a chunked body
        self.line_done = False  # the current head's request line has been fed whole

    @property
    def in_body(self) -> bool:
        """The next bytes belong to the body of the request being received."""
        return not (self.closed or self.passthrough) and bool(self._body_left or self._chunked)

    @property
    def in_request_line(self) -> bool:
        """The next bytes belong to a request line (or the empty lines before one)."""
        return not (
            self.closed or self.passthrough or self._body_left or self._chunked or self.line_done
        )

    def take(self, data: bytes) -> int:
        """How many leading bytes of ``data`` go to the parser now (0: ignore all of it)."""
        if self.closed:
            return 0
        if self.passthrough:
            return len(data)
        if self._body_left:
            return min(self._body_left, len(data))
        end = blank_line_end(self._tail, data)
        return len(data) if end < 0 else end

    def fed(self, piece: bytes) -> None:
        """``piece`` (what ``take`` allowed) went to the parser."""
        if self._body_left:
            self._body_left -= len(piece)
            if not self._body_left:
                self._tail = b""
                self._ended()
            return
        self._tail = (self._tail + piece)[-2:]

    def head(self, length: int, chunked: bool, closes: bool, upgrade: bool = False) -> None:
        """The parser made a request head of the bytes fed so far: its body is ``length``
        bytes (Content-Length), or chunked; ``closes``: the connection ends with it."""
        self._tail = b""
        self._close_after = closes
        if upgrade:
            self.passthrough = True
        elif chunked:
            self._chunked = True  # it ends at a blank line: reported by ``body_ended``
        elif length > 0:
            self._body_left = length
        else:
            self._ended()

    def body_ended(self) -> None:
        """The parser ended a chunked body at the end of the bytes fed so far."""
        self._tail = b""
        self._chunked = False
        self._ended()

    def refused(self) -> None:
        """The parser refused the bytes (the server answers 400 or 431 and closes)."""
        self.closed = True

    def _ended(self) -> None:
        self.line_done = False  # the next bytes start a request line
        if self._close_after:
            self.closed = True  # RFC 9112 section 9.6: no further request is read


def escape_request_line(piece: bytes, line: bytes) -> tuple[bytes, bytes, bool]:
    """``piece`` starts in a request line of which ``line`` came before: (the piece with every
    byte over 0x7F of the line percent-encoded, the line so far as sent, whether it ended in
    this piece). Empty lines before a request line (RFC 9112 section 2.2) are passed over."""
    start = 0
    if not line:
        while start < len(piece) and piece[start] in b"\r\n":
            start += 1
    end = piece.find(b"\n", start)
    stop = len(piece) if end < 0 else end
    part = piece[start:stop]
    # Only after the method: a method with such bytes is no token, and the parser refuses it.
    after = 0 if b" " in line else part.find(b" ")
    if after >= 0 and not part[after:].isascii():
        escaped = b"".join(b"%%%02X" % c if c > 0x7F else bytes((c,)) for c in part[after:])
        piece = piece[: start + after] + escaped + piece[stop:]
    return piece, line + part, end >= 0


def target_of(line: bytes) -> bytes | None:
    """The request target of a request line as sent (``METHOD SP target SP version``)."""
    parts = line.rstrip(b"\r").split(b" ")
    return parts[1] if len(parts) == 3 else None

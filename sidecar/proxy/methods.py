"""Request methods the C parser does not know: any token RFC 9110 allows is a method.

aiohttp's C parser (llhttp) knows a fixed list of methods and answers 400 to any other, where
nginx and the application answer what the application makes of it (a 405, usually): RFC 9110
section 9.1 makes a method any token, and a proxy forwards methods it does not know. Pure.

At the start of a request line (the server knows where one starts: ``framing.RequestFraming``
hands the parser one request at a time), a method the parser does not know is replaced by a
stand-in it knows (``GET``: its request framing is the same for every method but CONNECT), and
the parsed head gets the real method back before anything reads it. Nothing inside a request is
ever rewritten. A method token split across two reads is left to the parser (400): it is only
looked at in the read that starts the line.
"""

from __future__ import annotations

import re

# What llhttp accepts as a request method (checked against the installed parser by
# tests/proxy/test_methods.py); every other token is stood in for.
PARSER_METHODS = frozenset(
    {
        "DELETE", "GET", "HEAD", "POST", "PUT", "OPTIONS", "TRACE", "COPY", "LOCK", "MKCOL",
        "MOVE", "PROPFIND", "PROPPATCH", "SEARCH", "UNLOCK", "BIND", "REBIND", "UNBIND", "ACL",
        "REPORT", "MKACTIVITY", "CHECKOUT", "MERGE", "M-SEARCH", "NOTIFY", "SUBSCRIBE",
        "UNSUBSCRIBE", "PATCH", "PURGE", "MKCALENDAR", "LINK", "UNLINK", "SOURCE", "QUERY",
    }
)  # fmt: skip
# Never stood in for: CONNECT has its own framing (and is refused by routing), PRI is the
# HTTP/2 preface (refused as an HTTP version).
_SPECIAL = frozenset({b"CONNECT", b"PRI"})
_COMMON = (b"GET ", b"POST ", b"PUT ", b"HEAD ", b"DELETE ", b"OPTIONS ", b"PATCH ")
# RFC 9110 section 5.6.2: token = 1*tchar.
TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
MAX_METHOD = 64  # longer "methods" are left to the parser (400)
STAND_IN = b"GET"


def stand_in(data: bytes) -> tuple[bytes, str | None]:
    """``data`` (the start of a request head) with an unknown method replaced by the stand-in,
    and that method; unchanged with None when the method is one the parser knows or the read
    does not start with ``token SP``."""
    if data.startswith(_COMMON):
        return data, None
    sp = data.find(b" ", 0, MAX_METHOD + 1)
    if sp <= 0:
        return data, None
    token = data[:sp]
    if token in _SPECIAL or TOKEN.fullmatch(token) is None:
        return data, None
    method = token.decode("ascii")
    if method in PARSER_METHODS:
        return data, None
    return STAND_IN + data[sp:], method

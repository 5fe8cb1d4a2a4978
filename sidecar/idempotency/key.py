"""The ``Idempotency-Key`` header, parsed. Pure.

Two forms name the same key: the IETF draft's Structured Field string (``"abc"``, RFC 8941
section 3.3.3: ``\\"`` and ``\\\\`` are its only escapes) and the bare token Stripe's clients send
(``abc``). The key itself must be 1 to 255 visible ASCII characters (0x21-0x7E); anything else,
an empty value, or more than one ``Idempotency-Key`` field, is malformed.

The handler passes the headers as they go upstream: a key the client names in ``Connection`` is
hop-by-hop, already dropped there, and so is no key here -- as for the retry rules
(``retry.non_idempotent``), one reading of the header for the whole sidecar.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

HEADER = b"idempotency-key"
MAX_LENGTH = 255


@dataclass(frozen=True, slots=True)
class GoodKey:
    value: str  # unquoted: ``"abc"`` and ``abc`` are both ``abc``


@dataclass(frozen=True, slots=True)
class NoKey:
    pass


@dataclass(frozen=True, slots=True)
class BadKey:
    reason: str  # for the problem answer's ``detail``
    raw: str  # what was received (latin-1), cut to MAX_LENGTH characters


ParsedKey = GoodKey | NoKey | BadKey


def _visible(text: str) -> bool:
    return all("\x21" <= c <= "\x7e" for c in text)


def _unquote(raw: str) -> str | None:
    """The value of an sf-string, or None when ``raw`` is not exactly one."""
    if len(raw) < 2 or raw[0] != '"' or raw[-1] != '"':
        return None
    out: list[str] = []
    i, end = 1, len(raw) - 1
    while i < end:
        c = raw[i]
        if c == "\\":
            if i + 1 >= end or raw[i + 1] not in '"\\':
                return None
            out.append(raw[i + 1])
            i += 2
            continue
        if c == '"' or not ("\x20" <= c <= "\x7e"):
            return None
        out.append(c)
        i += 1
    return "".join(out)


def parse_value(value: bytes) -> ParsedKey:
    raw = value.decode("latin-1")
    shown = raw[:MAX_LENGTH]
    if raw.startswith('"'):
        inner = _unquote(raw)
        if inner is None:
            return BadKey("not a valid quoted string (RFC 8941 sf-string)", shown)
        raw = inner
    if not raw:
        return BadKey("empty", shown)
    if len(raw) > MAX_LENGTH:
        return BadKey(f"longer than {MAX_LENGTH} characters", shown)
    if not _visible(raw):
        return BadKey("not a visible ASCII string", shown)
    return GoodKey(raw)


def parse_key(headers: Iterable[tuple[bytes, bytes]]) -> ParsedKey:
    """The key of a request, from its headers (as they go upstream)."""
    values = [v for k, v in headers if k.lower() == HEADER]
    if not values:
        return NoKey()
    if len(values) > 1:
        shown = values[0].decode("latin-1")[:MAX_LENGTH]
        return BadKey("more than one Idempotency-Key field", shown)
    return parse_value(values[0])

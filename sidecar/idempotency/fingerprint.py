"""What makes two requests "the same", and the name a key is stored under. Pure.

The fingerprint covers the method, the target as sent, a digest of the body and, when the route
sets ``scope_header``, a digest of that header's value. The stored name of key K on route R is
``R/<scope> K`` (``stored_key``): the same K from two clients (two ``Authorization`` values) is
two keys, so one client never reads another's answer (the draft's composite key), and so is the
same K on two routes (two apps: a client's counter-style keys on two services never collide).
Only digests are stored, never the header's value. The previous versions stored ``<scope> K``,
without the route (``legacy_key``): a claim still reads that name, until it expires, so no
write runs twice across an upgrade.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

NO_SCOPE = "-"


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for part in parts:  # length-prefixed: no two different part lists hash alike
        h.update(len(part).to_bytes(8, "big"))
        h.update(part)
    return h.hexdigest()


# Credentials headers: ``auth-scheme 1*SP ( token68 / auth-param list )``, the scheme
# case-insensitive (RFC 9110 11.1, 11.4, 11.6.2, 11.7.2).
CREDENTIALS_HEADERS = frozenset({b"authorization", b"proxy-authorization"})


def credentials(value: bytes) -> bytes:
    """A credentials value as it identifies its client: the scheme lowercased and one space
    before the rest (however many spaces or tabs were sent), the rest as sent. Pure."""
    parts = value.strip(b" \t").split(None, 1)
    if not parts:
        return b""
    scheme = parts[0].lower()
    return scheme if len(parts) == 1 else scheme + b" " + parts[1].strip(b" \t")


def scope_digest(headers: Iterable[tuple[bytes, bytes]], scope_header: str | None) -> str:
    """NO_SCOPE when the route scopes nothing; else a digest of every value of the header, in
    order (absent is not the same as empty): as sent, but for ``Authorization`` and
    ``Proxy-Authorization``, whose scheme is case-insensitive (``credentials``)."""
    if scope_header is None:
        return NO_SCOPE
    name = scope_header.lower().encode("latin-1")
    values = [v for k, v in headers if k.lower() == name]
    if name in CREDENTIALS_HEADERS:
        values = [credentials(v) for v in values]
    return _digest(b"scope", str(len(values)).encode(), *values)


def fingerprint(method: str, target: bytes, body: bytes, scope: str) -> str:
    return _digest(
        method.encode("latin-1"), target, hashlib.sha256(body).digest(), scope.encode("ascii")
    )


def stored_key(key: str, scope: str, route: str) -> str:
    """A key never holds a space (visible ASCII only), so the space separates unambiguously; a
    route's name holds no ``/`` nor space (``config.checks.ROUTE_NAME``), a scope neither."""
    return f"{route}/{scope} {key}"


def legacy_key(key: str, scope: str) -> str:
    """The name the previous versions stored key K under (no route): read by a claim while
    the new name is absent, never written."""
    return f"{scope} {key}"

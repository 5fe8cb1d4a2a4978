"""Route matching: first match wins. Pure.

Paths are matched on the raw request target (before ``?``), exactly as the client sent it: no
percent-decoding or normalisation, so what a rule sees is what the upstream will see. An
absolute-form target is matched and forwarded by its path (``request_target``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from sidecar.config.model import Match, Route
from sidecar.proxy.forward import valid_host


def matches(m: Match, method: str, path: str, header: Callable[[str], str | None]) -> bool:
    if m.methods is not None and method not in m.methods:
        return False
    if m.path is not None and path != m.path:
        return False
    if m.path_prefix is not None and not path.startswith(m.path_prefix):
        return False
    if m.path_regex is not None and m.path_regex.fullmatch(path) is None:
        return False
    return all(header(name) == value for name, value in m.headers)


def find_route(
    routes: Sequence[Route], method: str, path: str, header: Callable[[str], str | None]
) -> Route | None:
    for route in routes:
        if matches(route.match, method, path, header):
            return route
    return None


@dataclass(
    slots=True, init=False
)  # one per request: not frozen, whose __init__ costs three times as much
class Target:
    """Where a request goes: matched on ``path``, forwarded as ``origin`` (origin-form), with
    ``authority`` replacing Host when the client sent an absolute-form target."""

    path: str
    origin: str
    authority: str | None = None

    # An explicit __init__: mypyc compiles it, where the one @dataclass generates stays
    # interpreted (~3,000 instructions per object made, against ~300). One is made per request.
    def __init__(self, path: str, origin: str, authority: str | None = None) -> None:
        self.path = path
        self.origin = origin
        self.authority = authority


@dataclass(frozen=True, slots=True)
class Refused:
    status: int
    message: str


def request_target(method: str, raw: str, host: str | None) -> Target | Refused:
    """Read the request target as RFC 9112 section 3.2 defines it. Pure.

    - origin-form (``/path?q``): matched and forwarded as sent;
    - absolute-form (``http://host/path?q``, what clients send with ``http_proxy`` set):
      matched and forwarded by its path (origin-form upstream), Host taken from the URI
      (section 3.2.2), so path-prefix routes cannot be bypassed;
    - ``CONNECT`` (authority-form) and ``OPTIONS *`` (asterisk-form) are refused with 400, as
      nginx does: the sidecar proxies requests to routes, it is not a tunnel, and ``*`` has
      no path to route on.

    A Host field value that is not ``host[:port]`` is refused with 400 (nginx does the same).
    """
    if method == "CONNECT":
        return Refused(400, "CONNECT is not supported: the sidecar is not a tunnel")
    if raw.startswith("/"):
        if host is not None and not _valid_host(host):
            return Refused(400, "invalid Host header")
        path = raw.split("?", 1)[0]
        return Target(path, raw)
    if raw == "*":
        return Refused(400, "asterisk-form (OPTIONS *) is not supported")
    scheme, sep, rest = raw.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return Refused(400, "request target is neither origin-form nor an http(s) URI")
    cut = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if 0 <= i < cut:
            cut = i
    authority, tail = rest[:cut], rest[cut:]
    if not authority or "@" in authority or not _valid_host(authority):
        return Refused(400, "invalid authority in the request target")
    if tail.startswith("#"):
        tail = ""
    if not tail.startswith("/"):
        if method == "OPTIONS":
            return Refused(400, "asterisk-form (OPTIONS *) is not supported")
        tail = "/" + tail  # an empty path is "/" (RFC 9112 section 3.2.1)
    return Target(tail.split("?", 1)[0], tail, authority)


def _valid_host(value: str) -> bool:
    try:
        raw = value.encode("latin-1")
    except UnicodeEncodeError:
        return False
    return valid_host(raw)

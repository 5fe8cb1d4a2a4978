"""Route matching: first match wins. Pure.

Paths are matched on the raw request target (before ``?``), exactly as the client sent it: no
percent-decoding or normalisation, so what a rule sees is what the upstream will see.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sidecar.config.model import Match, Route


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

"""The endpoints of one route and which one an attempt goes to. Pure, clock injected.

A route names one or more upstream URLs; a host name among them stands for every address it
resolves to (re-resolved by the engine). Attempts take the endpoints in turn (round robin), and
a retry or a hedge prefers an endpoint that this sequence has not used yet: the one that just
failed, or the one still busy with the attempt being hedged, is taken only if no other is left.

Passive health, as Envoy's outlier detection for locally-originated failures: after
``EJECT_AFTER`` consecutive connection failures (refused, reset, no answer in time) an endpoint
is skipped for ``EJECT_BASE`` seconds, doubled on each further ejection up to ``EJECT_MAX``;
any response from it clears the count. Ejection never leaves a route without endpoints: when
every endpoint is ejected, all are used (Envoy's panic threshold). A route with one endpoint
never ejects it -- there is nothing to prefer instead.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

EJECT_AFTER = 3
EJECT_BASE = 1.0
EJECT_MAX = 30.0


@dataclass(eq=False, slots=True)
class Endpoint:
    host: str  # what to connect to: an IP address, or a host name not resolved yet
    port: int
    name: str = ""  # the configured authority it came from, for logs and spans
    failures: int = 0  # consecutive connection failures
    ejections: int = 0
    ejected_until: float = 0.0
    key: tuple[str, int] = field(init=False)

    def __post_init__(self) -> None:
        self.key = (self.host, self.port)
        if not self.name:
            self.name = self.authority

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until


class EndpointSet:
    __slots__ = ("_next", "ejections", "endpoints")

    def __init__(self, addresses: Iterable[tuple[str, int, str]]) -> None:
        self.endpoints: list[Endpoint] = [Endpoint(h, p, n) for h, p, n in addresses]
        self._next = 0
        self.ejections = 0
        if not self.endpoints:
            raise ValueError("a route needs at least one endpoint")

    def update(self, addresses: Iterable[tuple[str, int, str]]) -> None:
        """New addresses (a reload, a DNS answer): endpoints kept keep their health."""
        old = {e.key: e for e in self.endpoints}
        new = []
        for h, p, n in addresses:
            e = old.get((h, p))
            if e is None:
                e = Endpoint(h, p, n)
            new.append(e)
        if new:
            self.endpoints = new
            self._next %= len(new)

    def pick(self, now: float, avoid: Collection[Endpoint] = ()) -> Endpoint:
        """The next endpoint in turn, preferring healthy ones not in ``avoid``."""
        eps = self.endpoints
        n = len(eps)
        if n == 1:
            return eps[0]
        fallback: Endpoint | None = None
        panic: Endpoint | None = None
        for i in range(n):
            e = eps[(self._next + i) % n]
            if panic is None:
                panic = e
            if e.ejected(now):
                continue
            if e in avoid:
                if fallback is None:
                    fallback = e
                continue
            self._next = (self._next + i + 1) % n
            return e
        chosen = fallback or panic
        assert chosen is not None
        self._next = (eps.index(chosen) + 1) % n
        return chosen

    def report(self, now: float, endpoint: Endpoint, connection_failed: bool) -> None:
        """How an attempt to ``endpoint`` ended: a connection failure, or any response."""
        if not connection_failed:
            endpoint.failures = 0
            endpoint.ejections = 0
            return
        endpoint.failures += 1
        if len(self.endpoints) > 1 and endpoint.failures >= EJECT_AFTER:
            endpoint.ejected_until = now + min(
                EJECT_MAX, EJECT_BASE * 2.0 ** min(endpoint.ejections, 16)
            )
            endpoint.ejections += 1
            endpoint.failures = 0
            self.ejections += 1

    def healthy(self, now: float) -> int:
        return sum(1 for e in self.endpoints if not e.ejected(now))

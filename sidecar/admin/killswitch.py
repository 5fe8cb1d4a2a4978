"""The runtime kill switch: retries off, globally or per route, each switch with an expiry.

A switch is a real mode of the same code path: the retry engine makes exactly one attempt and
reports ``x-retry-fate: kill-switch`` when a retry was wanted. It is held in memory only: a
restart clears it, on purpose. A restarted sidecar comes back with the policy in its file; a
switch that should outlive restarts belongs in the file (``attempts: 1``) where review sees it.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_TTL = 24 * 3600.0


@dataclass(frozen=True, slots=True)
class Switch:
    scope: str  # "global" or "route:<name>"
    reason: str
    set_by: str
    set_at: float  # epoch seconds
    expires_at: float  # epoch seconds
    expires_mono: float

    def as_json(self) -> dict[str, object]:
        return {
            "scope": self.scope,
            "reason": self.reason,
            "set_by": self.set_by,
            "set_at": self.set_at,
            "expires_at": self.expires_at,
        }


class KillSwitch:
    def __init__(self) -> None:
        self._switches: dict[str, Switch] = {}

    def set(self, scope: str, ttl: float, reason: str, who: str, now: float, wall: float) -> Switch:
        if not 0 < ttl <= MAX_TTL:
            raise ValueError("ttl must be greater than 0 and at most 24h")
        sw = Switch(scope, reason, who, wall, wall + ttl, now + ttl)
        self._switches[scope] = sw
        return sw

    def lift(self, scope: str) -> bool:
        return self._switches.pop(scope, None) is not None

    def active(self, now: float) -> list[Switch]:
        self._prune(now)
        return sorted(self._switches.values(), key=lambda s: s.scope)

    def covers(self, route: str, now: float) -> bool:
        if not self._switches:  # the common case costs one check
            return False
        self._prune(now)
        return "global" in self._switches or f"route:{route}" in self._switches

    def _prune(self, now: float) -> None:
        for scope in [s for s, sw in self._switches.items() if sw.expires_mono <= now]:
            del self._switches[scope]

"""The runtime kill switch: retries off, globally or per route, each switch with an expiry.

A switch is a real mode of the same code path: the retry engine makes exactly one attempt and
reports ``x-retry-fate: kill-switch`` when a retry was wanted.

Switches come from three sources, kept apart:

- ``admin``: set and lifted through the admin API (or the status page's forms), held in memory
  only. A restart clears them, on purpose: a restarted sidecar comes back with what its file says.
- ``file``: the ``killswitches:`` section of the policy file. Every (re)load replaces the whole
  set of file switches with what the file says now, so one ConfigMap edit reaches every pod of
  a fleet, and deleting the entry lifts it everywhere. They cannot be lifted through the admin
  API: the file is the fleet's truth and would put them back on the next reload or restart.

- ``fleet`` (``fleet.killswitch: true``): set and lifted through any sidecar's admin API (or
  status page), shared through the fleet's Redis (``sidecar/fleet/switches.py``) so that every
  sidecar sharing it applies them. With it on, the admin API sets and lifts fleet switches
  instead of admin ones; while the Redis cannot take a set or a lift, it is refused
  (``FleetUnavailable``, a 503): nothing is applied on this pod only without the operator
  knowing. A fleet switch's ``expires_at`` is a wall-clock instant, like a file switch's.

A scope is covered while a switch of any source is active for it.

An admin switch lasts a TTL, a duration: it ends on the monotonic clock, which no host clock
correction moves. A file switch's ``until`` is an instant: it is compared with the wall clock
(injected) each time the switches are asked about, so a clock stepped back or forward moves its
end with it, as the fleet's other pods (and the operator reading the file) see it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from sidecar.config import units
from sidecar.config.killswitches import expired_warning
from sidecar.config.model import Config, FileKillSwitch
from sidecar.fleet.switches import FleetSwitch, FleetSwitches

MAX_TTL = 24 * 3600.0
MAX_REASON = 1000
Source = Literal["admin", "file", "fleet"]
audit = logging.getLogger("sidecar.audit")
log = logging.getLogger("sidecar.admin")


class BadRequest(ValueError):
    """A set request that cannot be applied; the message says why, for a 400."""


def check_set(
    scope: object, ttl_raw: object, reason: object, has_route: Callable[[str], bool]
) -> tuple[str, float, str]:
    """Validate a set request (the admin API's and the status page's alike)."""
    if not isinstance(scope, str) or not (
        scope == "global" or (scope.startswith("route:") and has_route(scope[6:]))
    ):
        raise BadRequest("scope must be 'global' or 'route:<name>' naming a configured route")
    if ttl_raw is None or ttl_raw == "":
        raise BadRequest('ttl is required, e.g. "15m" (at most 24h)')
    try:
        ttl = units.parse_duration(ttl_raw)
    except units.UnitError as exc:
        raise BadRequest(f"ttl: {exc}") from None
    if not 0 < ttl <= MAX_TTL:
        raise BadRequest("ttl must be greater than 0 and at most 24h")
    if not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON:
        raise BadRequest(
            f"reason is required: a non-empty string of at most {MAX_REASON} characters"
        )
    return scope, ttl, reason


def iso(epoch: float) -> str:
    return (
        datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def audit_set(sw: Switch, ttl: float, via: str) -> None:
    audit.warning(
        "kill switch set",
        extra={
            "fields": {
                "audit": "killswitch.set",
                "who": sw.set_by,
                "via": via,
                "scope": sw.scope,
                "reason": sw.reason,
                "ttl_seconds": ttl,
                "expires_at": iso(sw.expires_at),
            }
        },
    )


def audit_lift(scope: str, who: str, via: str) -> None:
    audit.warning(
        "kill switch lifted",
        extra={"fields": {"audit": "killswitch.lift", "who": who, "via": via, "scope": scope}},
    )


@dataclass(frozen=True, slots=True)
class Switch:
    scope: str  # "global" or "route:<name>"
    reason: str
    set_by: str  # the peer address, or "<file>:<line>" for a file switch
    set_at: float  # epoch seconds
    expires_at: float  # epoch seconds
    # An admin switch's end on the monotonic clock (set time + TTL); None for a file switch,
    # which ends at the wall-clock instant ``expires_at``.
    expires_mono: float | None
    source: Source = "admin"
    set_on: str | None = None  # a fleet switch: the name of the sidecar it was set through

    def as_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "scope": self.scope,
            "reason": self.reason,
            "set_by": self.set_by,
            "set_at": self.set_at,
            "expires_at": self.expires_at,
            "source": self.source,
        }
        if self.set_on is not None:
            out["set_on"] = self.set_on
        return out


def from_fleet(sw: FleetSwitch) -> Switch:
    return Switch(
        sw.scope, sw.reason, sw.set_by, sw.set_at, sw.expires_at, None, "fleet", sw.set_on
    )


class KillSwitch:
    def __init__(
        self, wall: Callable[[], float] = time.time, fleet: FleetSwitches | None = None
    ) -> None:
        self._wall = wall  # what a file or fleet switch's end is compared with
        self._admin: dict[str, Switch] = {}
        self._file: dict[str, Switch] = {}
        self.fleet = fleet  # None unless fleet.killswitch is on
        # Called when a switch is set (admin, file or fleet): backoff sleeps ask again whether
        # their retry may still be sent (Lifecycle.nudge_sleepers).
        self._on_set: list[Callable[[], None]] = []
        if fleet is not None:
            fleet.on_change(self._notify)

    def on_set(self, listener: Callable[[], None]) -> None:
        self._on_set.append(listener)

    def _notify(self) -> None:
        for listener in self._on_set:
            listener()

    def set(self, scope: str, ttl: float, reason: str, who: str, now: float, wall: float) -> Switch:
        """An admin switch; setting a scope again replaces its reason and expiry."""
        if not 0 < ttl <= MAX_TTL:
            raise ValueError("ttl must be greater than 0 and at most 24h")
        sw = Switch(scope, reason, who, wall, wall + ttl, now + ttl)
        self._admin[scope] = sw
        self._notify()
        return sw

    def lift(self, scope: str) -> bool:
        """Lift an admin switch. File switches are lifted by editing the file."""
        return self._admin.pop(scope, None) is not None

    async def set_from_api(
        self, scope: str, ttl: float, reason: str, who: str, now: float, wall: float
    ) -> Switch:
        """A set through the admin API or the status page: a fleet switch when fleet switches
        are on (``FleetUnavailable`` when the Redis cannot take it), else an admin switch."""
        if self.fleet is None:
            return self.set(scope, ttl, reason, who, now, wall)
        if not 0 < ttl <= MAX_TTL:
            raise ValueError("ttl must be greater than 0 and at most 24h")
        sw = FleetSwitch(scope, reason, who, self.fleet.name, wall, wall + ttl)
        await self.fleet.set(sw)
        return from_fleet(sw)

    async def lift_from_api(self, scope: str) -> bool:
        """A lift through the admin API or the status page: the admin switch of ``scope`` and,
        when fleet switches are on, the fleet's (``FleetUnavailable`` when the Redis cannot
        take it); whether one was in force."""
        in_fleet = self.fleet is not None and await self.fleet.lift(scope)
        return self.lift(scope) or in_fleet

    def file_state(self) -> dict[str, Switch]:
        """The file switches as they are, for ``restore_file`` (an apply that failed)."""
        return dict(self._file)

    def restore_file(self, state: dict[str, Switch]) -> None:
        self._file = dict(state)

    def file_switch(self, scope: str, now: float) -> Switch | None:
        self._prune(now)
        return self._file.get(scope)

    def load_file(
        self, entries: Iterable[FileKillSwitch], source: str, wall: float
    ) -> list[FileKillSwitch]:
        """Replace every file switch with ``entries``; return the ones already expired, which
        are ignored. An entry unchanged since the last load keeps its ``set_at``."""
        expired: list[FileKillSwitch] = []
        fresh: dict[str, Switch] = {}
        for e in entries:
            if e.until <= wall:
                expired.append(e)
                continue
            old = self._file.get(e.scope)
            set_at = (
                old.set_at if old and (old.reason, old.expires_at) == (e.reason, e.until) else wall
            )
            fresh[e.scope] = Switch(
                e.scope,
                e.reason,
                f"{source}:{e.line}",
                set_at,
                e.until,
                None,
                "file",
            )
        self._file = fresh
        if fresh:
            self._notify()
        return expired

    def active(self, now: float) -> list[Switch]:
        self._prune(now)
        every = [*self._admin.values(), *self._file.values(), *self._fleet_active()]
        return sorted(every, key=lambda s: (s.scope, s.source))

    def _fleet_active(self) -> list[Switch]:
        if self.fleet is None:
            return []
        return [from_fleet(sw) for sw in self.fleet.active(self._wall())]

    def covers(self, route: str, now: float) -> bool:
        fleet = self.fleet is not None and self.fleet.any_known()
        if not self._admin and not self._file and not fleet:  # the common case: two checks
            return False
        self._prune(now)
        scope = f"route:{route}"
        if any("global" in d or scope in d for d in (self._admin, self._file)):
            return True
        return fleet and any(s.scope in ("global", scope) for s in self._fleet_active())

    def _prune(self, now: float) -> None:
        for scope, sw in list(self._admin.items()):
            if sw.expires_mono is not None and sw.expires_mono <= now:
                del self._admin[scope]
        if self._file:
            wall = self._wall()
            for scope in [s for s, sw in self._file.items() if sw.expires_at <= wall]:
                del self._file[scope]


def apply_file(kill: KillSwitch, config: Config, now: float, wall: float) -> None:
    """On every (re)load: the file's switches replace the previous file switches. Expired
    entries are ignored with a warning that names their line; a change is an audit line."""
    before = {(s.scope, s.reason, s.expires_at) for s in kill.active(now) if s.source == "file"}
    for e in kill.load_file(config.killswitches, config.source, wall):
        log.warning(expired_warning(config.source, e))
    now_on = [s for s in kill.active(now) if s.source == "file"]
    if {(s.scope, s.reason, s.expires_at) for s in now_on} != before:
        audit.warning(
            "kill switches from the policy file",
            extra={
                "fields": {
                    "audit": "killswitch.file",
                    "who": config.source,
                    "switches": [
                        {"scope": s.scope, "reason": s.reason, "expires_at": iso(s.expires_at)}
                        for s in now_on
                    ],
                }
            },
        )

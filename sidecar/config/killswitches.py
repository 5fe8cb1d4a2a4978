"""The ``killswitches:`` section: fleet-wide kill switches written in the policy file.

    killswitches:
      - scope: route:orders          # or "global"
        reason: "INC-123 retries amplify the outage"
        until: 2025-06-01T12:00:00Z  # RFC 3339, with Z or an offset

Validation is pure (no clock): whether an entry has already expired is decided when the file
is applied (``expired``), and such an entry is ignored with a warning rather than refused, so
a fleet does not stop reloading because an old entry was left behind.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from datetime import UTC, date, datetime

from sidecar.config.fileswitch import FileKillSwitch
from sidecar.config.yamlnodes import Located, Path

MAX_REASON = 1000
# RFC 3339 section 5.6 date-time; "T"/"Z" may be lower case, a space may stand for "T".
_RFC3339 = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:\d{2})$")
KEYS = ("scope", "reason", "until")
FIRST = "0001-01-01T00:00:00Z"
LAST = "9999-12-31T23:59:59Z"


def parse_until(value: object) -> float:
    """Epoch seconds of an RFC 3339 date-time with an offset; ValueError otherwise.

    YAML turns an unquoted timestamp into a datetime already; it is accepted only when it
    carries an offset, because a time without one means different instants on different pods.
    The instant must also be one this process can show again as a UTC time (every use of it
    does: the audit line, ``GET /killswitch``, the status page): ``9999-12-31T23:59:59-05:00``
    is in the year 10000 in UTC, ``0001-01-01T00:00:00+23:59`` in the year 0.
    """
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError(
                "needs a UTC offset, e.g. 2025-06-01T12:00:00Z or 2025-06-01T14:00:00+02:00"
            )
        return _representable(value)
    if isinstance(value, date):
        raise ValueError("needs a time of day and an offset, e.g. 2025-06-01T12:00:00Z")
    if not isinstance(value, str) or not _RFC3339.match(value):
        raise ValueError(f"expected an RFC 3339 time like 2025-06-01T12:00:00Z, got {value!r}")
    text = value.upper().replace(" ", "T")
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError as exc:
        raise ValueError(f"not a valid time: {exc}") from None
    return _representable(parsed)


def _representable(value: datetime) -> float:
    """``value`` as epoch seconds, when those seconds turn back into a UTC date-time (the
    float may round up past the last representable instant too)."""
    try:
        epoch = value.astimezone(UTC).timestamp()
        datetime.fromtimestamp(epoch, UTC)
    except (OverflowError, ValueError, OSError):
        raise ValueError(
            f"{value.isoformat()} is outside the times this process can represent "
            f"({FIRST} to {LAST} in UTC)"
        ) from None
    return epoch


def parse_section(
    value: object,
    located: Located,
    route_names: set[str],
    error: Callable[[Path, str], None],
) -> tuple[FileKillSwitch, ...]:
    """Validate the section; every problem goes to ``error`` with its key path."""
    path: Path = ("killswitches",)
    if value is None:
        return ()
    if not isinstance(value, list):
        error(path, "expected a list of {scope, reason, until} entries")
        return ()
    out: list[FileKillSwitch] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(value):
        p: Path = (*path, i)
        if not isinstance(item, dict):
            error(p, "expected a mapping with scope, reason and until")
            continue
        ok = True
        for key in item:
            if key not in KEYS:
                error((*p, key), f"unknown key (allowed: {', '.join(KEYS)})")
                ok = False
        for key in KEYS:
            if key not in item:
                error((*p, key), "required")
                ok = False
        scope = item.get("scope")
        if "scope" in item:
            if not isinstance(scope, str) or not _scope_ok(scope, route_names):
                error(
                    (*p, "scope"),
                    "must be 'global' or 'route:<name>' naming a route of this file; "
                    f"got {scope!r}",
                )
                ok = False
            elif scope in seen:
                error((*p, "scope"), f"duplicate scope (also killswitches[{seen[scope]}])")
                ok = False
            else:
                seen[scope] = i
        reason = item.get("reason")
        if "reason" in item and (
            not isinstance(reason, str) or not reason.strip() or len(reason) > MAX_REASON
        ):
            error((*p, "reason"), f"must be a non-empty string of at most {MAX_REASON} characters")
            ok = False
        until = 0.0
        if "until" in item:
            try:
                until = parse_until(item["until"])
            except ValueError as exc:
                error((*p, "until"), str(exc))
                ok = False
        if ok:
            assert isinstance(scope, str) and isinstance(reason, str)
            out.append(FileKillSwitch(scope, reason, until, located.line(p), i))
    return tuple(out)


def _scope_ok(scope: str, route_names: set[str]) -> bool:
    return scope == "global" or (scope.startswith("route:") and scope[6:] in route_names)


def expired(entries: Iterable[FileKillSwitch], wall: float) -> list[FileKillSwitch]:
    return [e for e in entries if e.until <= wall]


def expired_warning(source: str, e: FileKillSwitch) -> str:
    """``PATH:LINE: killswitches[i].until: ...``, the shape of every config message."""
    until = datetime.fromtimestamp(e.until, UTC).isoformat().replace("+00:00", "Z")
    return (
        f"{source}:{e.line}: killswitches[{e.index}].until: {until} has passed; "
        f"the {e.scope} switch is ignored"
    )

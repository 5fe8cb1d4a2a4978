"""Whether the fleet's Redis keeps what it acknowledged: ``appendonly yes`` and ``appendfsync
always`` (every write in its append-only file, fsynced before the answer), which the README asks
of a Redis that holds the DLQ's records, read with ``CONFIG GET`` at start.

A mismatch is a warning, not a refusal: the sidecar still runs (the DLQ still takes records,
and a Redis crash may lose the last ones it acknowledged), says so in a log line, on the status
page and in ``GET /status``. A managed Redis often disables ``CONFIG`` (an "unknown command" or
a permission error): that is "cannot check", also a warning, never a reason not to start.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from sidecar.fleet.connection import FleetLink

if TYPE_CHECKING:
    from redis.asyncio import Redis

WANTED = {"appendonly": "yes", "appendfsync": "always"}


def judge(settings: Mapping[str, str]) -> str | None:
    """The warning for what ``CONFIG GET`` answered, or None when every write is fsynced. Pure."""
    wrong = [
        f"{name} {settings.get(name, 'unknown')}"
        for name, want in WANTED.items()
        if settings.get(name) != want
    ]
    if not wrong:
        return None
    return (
        f"the fleet Redis runs with {', '.join(wrong)}: records it acknowledged can be lost "
        "if it crashes; run it with appendonly yes and appendfsync always"
    )


def cannot_check(reason: str) -> str:
    return (
        f"cannot check that the fleet Redis runs with appendonly yes and appendfsync always "
        f"(CONFIG GET: {reason}); make sure it does, or acknowledged records can be lost"
    )


async def check(link: FleetLink) -> str | None:
    """Ask the Redis (one call, bounded by its timeout); raises ``FleetUnavailable`` when it
    cannot be reached, so the caller asks again later."""
    from redis.exceptions import ResponseError

    async def ask(c: Redis) -> dict[Any, Any] | ResponseError:
        try:
            got: dict[Any, Any] = await c.config_get("append*")
            return got
        except ResponseError as exc:  # CONFIG disabled or renamed, or no permission
            return exc

    got = await link.call(ask)
    if isinstance(got, ResponseError):
        return cannot_check(str(got) or type(got).__name__)
    return judge({_text(k): _text(v) for k, v in got.items()})


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

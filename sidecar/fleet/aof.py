"""Whether the fleet's Redis keeps what it acknowledged: ``appendonly yes`` and ``appendfsync
always`` (every write in its append-only file, fsynced before the answer), which docs/fleet.md asks
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


async def config_get(link: FleetLink, pattern: str) -> dict[str, str] | str:
    """``CONFIG GET pattern`` (one call, bounded by the link's timeout) as text, or the reason
    the Redis would not say (``CONFIG`` disabled or renamed, no permission); raises
    ``FleetUnavailable`` when it cannot be reached, so the caller asks again later. The one
    reader of the Redis's settings: this module's and ``fleet.eviction``'s checks."""
    from redis.exceptions import ResponseError

    async def ask(c: Redis) -> dict[Any, Any] | ResponseError:
        try:
            got: dict[Any, Any] = await c.config_get(pattern)
            return got
        except ResponseError as exc:
            return exc

    got = await link.call(ask)
    if isinstance(got, ResponseError):
        return str(got) or type(got).__name__
    return {_text(k): _text(v) for k, v in got.items()}


async def check(link: FleetLink) -> str | None:
    """The warning for the Redis's append-only settings, or None (``config_get``'s errors)."""
    got = await config_get(link, "append*")
    return cannot_check(got) if isinstance(got, str) else judge(got)


def _text(v: object) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)

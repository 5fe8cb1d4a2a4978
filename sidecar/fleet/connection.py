"""The fleet's Redis client, and the pause before it is asked again after a failure.

``redis`` (its asyncio client) is imported only here and only when fleet mode is on: a sidecar
without ``fleet.redis.url`` never loads it. Every command is bounded by ``fleet.redis.timeout``
(the socket's read and connect timeouts, and the caller's ``asyncio.timeout`` around a whole
call); the client does not retry by itself, so one call never takes several timeouts.

After a failure the Redis is left alone for a pause that doubles up to ``BACKOFF_MAX``
(``ReconnectPause``, pure, clock-injected): calls in the pause fail at once instead of each waiting
its timeout on a Redis that is down or paused; the first call after it tries again, and a
success ends the pause. redis-py reconnects by itself on that call.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sidecar.config.fleet import FleetRedis
from sidecar.core import Clock

if TYPE_CHECKING:
    from redis.asyncio import Redis

T = TypeVar("T")
BACKOFF_FIRST = 0.1  # seconds after the first failure; doubled each time
BACKOFF_MAX = 2.0


class FleetUnavailable(Exception):
    """The fleet's Redis could not answer (unreachable, failing, slower than its timeout, or
    in the pause after such a failure)."""


def password(settings: FleetRedis, environ: Mapping[str, str]) -> str | None:
    """The password from the variable ``password_env`` names; None when unset or empty."""
    if settings.password_env is None:
        return None
    return environ.get(settings.password_env) or None


def make_client(settings: FleetRedis, environ: Mapping[str, str] | None = None) -> Redis:
    """A client of ``settings.url`` (which must be set), no retries of its own."""
    assert settings.url is not None, "fleet mode needs fleet.redis.url"
    from redis.asyncio import Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    options: dict[str, Any] = {
        "socket_timeout": settings.timeout,
        "socket_connect_timeout": settings.timeout,
        "retry_on_timeout": False,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
        "client_name": "retry-sidecar",
    }
    secret = password(settings, os.environ if environ is None else environ)
    if secret is not None:
        options["password"] = secret
    return Redis.from_url(settings.url, **options)


def failures() -> tuple[type[BaseException], ...]:
    """What a call to the client raises when Redis cannot answer."""
    from redis.exceptions import RedisError

    return (RedisError, OSError, TimeoutError)


@dataclass(slots=True)
class ReconnectPause:
    """When the Redis may be asked again. Pure: times are the caller's monotonic clock."""

    failures: int = 0
    next_try: float = 0.0  # monotonic; asked again from then on

    def ready(self, now: float) -> bool:
        return now >= self.next_try

    def delay(self) -> float:
        if self.failures == 0:
            return 0.0
        return float(min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (self.failures - 1)))

    def failed(self, now: float) -> None:
        self.failures += 1
        self.next_try = now + self.delay()

    def succeeded(self) -> None:
        self.failures = 0
        self.next_try = 0.0

    @property
    def connected(self) -> bool:
        """Whether the last call reached Redis (True before the first call)."""
        return self.failures == 0


class FleetLink:
    """One client of the fleet's Redis with its pause after failures: every call bounded by
    ``timeout``, a failure a ``FleetUnavailable``."""

    def __init__(
        self, settings: FleetRedis, clock: Clock, environ: Mapping[str, str] | None = None
    ) -> None:
        self.client = make_client(settings, environ)
        self.prefix = settings.key_prefix
        self.timeout = settings.timeout
        self.backoff = ReconnectPause()
        self._clock = clock
        self._failures = failures()

    @property
    def connected(self) -> bool:
        return self.backoff.connected

    async def call(self, fn: Callable[[Redis], Awaitable[T]]) -> T:
        """``fn(client)`` within ``timeout``; ``FleetUnavailable`` when Redis cannot answer
        or is in its pause. A cancelled call is no failure of Redis's."""
        now = self._clock.monotonic()
        if not self.backoff.ready(now):
            wait = self.backoff.next_try - now
            raise FleetUnavailable(f"the fleet Redis is unreachable (next try in {wait:.1f}s)")
        try:
            async with asyncio.timeout(self.timeout):
                result = await fn(self.client)
        except self._failures as exc:
            self.backoff.failed(self._clock.monotonic())
            timed_out = type(exc).__name__ == "TimeoutError"  # asyncio's or redis-py's
            kind = "did not answer in time" if timed_out else str(exc) or type(exc).__name__
            raise FleetUnavailable(f"the fleet Redis is unreachable: {kind}") from None
        self.backoff.succeeded()
        return result

    async def close(self) -> None:
        await self.client.aclose()

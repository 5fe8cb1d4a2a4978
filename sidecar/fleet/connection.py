"""The fleet's Redis client, and the pause before it is asked again after a failure.

``redis`` (its asyncio client) is imported only here and only when fleet mode is on: a sidecar
without ``fleet.redis.url`` never loads it. Every command is bounded by ``fleet.redis.timeout``
(the socket's read and connect timeouts, and the caller's ``asyncio.timeout`` around a whole
call); the client does not retry by itself, so one call never takes several timeouts.

After a failure the Redis is left alone for a pause that doubles up to ``BACKOFF_MAX``
(``ReconnectPause``, pure, clock-injected): calls in the pause fail at once instead of each waiting
its timeout on a Redis that is down or paused; the first call after it tries again, and a
success ends the pause. redis-py reconnects by itself on that call. A failure is logged as a
warning with Redis's own words, once per kind per 30 s (``report.ErrorReport``), and its text is
kept for the status page. A link is named for its use (``use``: ``killswitch``,
``idempotency``, ``dlq``), which the warnings name and under which ``links.FleetLinks`` shows
it; the first success after a warning is logged too (the Redis answers again).

Connections. The pool hands out a connection only after checking it (redis-py's
``ensure_connection``): one that Redis closed while it sat idle (a Redis restart, an idle
timeout) shows end-of-file, and is replaced by a new connection before any command is sent on
it, so a restart is no failure of the next call. redis-py skips that check when its
"maintenance notifications" are on (``auto`` by default, for Redis Enterprise and Cloud
endpoints that push them): they are turned off here. Its other means were rejected: a
``health_check_interval`` PING reconnects only through the client's ``Retry``, and a ``Retry``
with retries re-sends pipelines and commands that may have run (a claim, a switch write must
not run twice). What remains: a connection cut while a command is on it (Redis restarted
mid-command), or one whose peer vanished without closing it (no end-of-file to see), fails that
call, as it should: Redis may or may not have run the command. A write refused with ``OOM`` (a
Redis at its ``maxmemory``, ``noeviction``) is Redis answering, no failure: a ``FleetFull`` for
that call, no pause, the link stays connected (its reads and deletes go on).

A link whose calls come in bursts (the idempotency store's: two per guarded write) opens its
connections at start (``open_connections``), so a burst never waits for connects on the loop (a
connect mid-burst held calls 150-316 ms).

At most ``CALLS_MAX`` calls of one link are in flight at once; a call beyond them waits for one
to end, within its own ``timeout``. Each call holds one connection at a time (one command, one
pipeline or one script), so the pool (``CALLS_MAX`` plus ``SPARE`` for a subscription and the
like, a blocking pool) never runs out, and a burst during a short stall waits instead of failing
with "Too many connections". A call that found no free slot within its timeout is a local
shortage, not a failure of Redis's: it is a ``FleetUnavailable`` that starts no pause.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from sidecar.config.fleet import FleetRedis
from sidecar.core import Clock
from sidecar.fleet.report import ErrorReport

if TYPE_CHECKING:
    from redis.asyncio import Redis

T = TypeVar("T")
# Calls of one link in flight at once. Redis runs commands one at a time, and a call holds its
# connection for a round trip (about 0.1-1 ms), so 64 carry tens of thousands of calls a second;
# more would only open more sockets during a stall (N replicas x links x CALLS_MAX at the Redis,
# far below its default maxclients of 10000) without any call being answered sooner.
CALLS_MAX = 64
SPARE = 4  # connections beyond CALLS_MAX: the kill switches' subscription and the like
BACKOFF_FIRST = 0.1  # seconds after the first failure; doubled each time
BACKOFF_MAX = 2.0
log = logging.getLogger("sidecar.fleet")


class FleetUnavailable(Exception):
    """The fleet's Redis could not answer (unreachable, failing, slower than its timeout, or
    in the pause after such a failure)."""


class FleetFull(FleetUnavailable):
    """Redis refused a write with ``OOM`` (at its ``maxmemory``, ``noeviction``). Redis
    answered: no failure of the link (no pause, the link stays connected, its other calls go
    on, reads and deletes among them); the caller's write did not happen."""


class BadReply(Exception):
    """A reply that does not have the shape its command answers: another server on Redis's
    port, or a proxy in between. Raised by a use that checks what it got; a failure of the
    link like any other (its pause, its error shown)."""


def password(settings: FleetRedis, environ: Mapping[str, str]) -> str | None:
    """The password from the variable ``password_env`` names; None when unset or empty."""
    if settings.password_env is None:
        return None
    return environ.get(settings.password_env) or None


def make_client(settings: FleetRedis, environ: Mapping[str, str] | None = None) -> Redis:
    """A client of ``settings.url`` (which must be set), no retries of its own."""
    assert settings.url is not None, "fleet mode needs fleet.redis.url"
    from redis.asyncio import BlockingConnectionPool, Redis
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff
    from redis.maint_notifications import MaintNotificationsConfig

    options: dict[str, Any] = {
        "socket_timeout": settings.timeout,
        "socket_connect_timeout": settings.timeout,
        "retry_on_timeout": False,
        "retry": Retry(NoBackoff(), 0),
        "decode_responses": False,
        "client_name": "retry-sidecar",
        # Off, so that the pool checks an idle connection before handing it out (see above).
        "maint_notifications_config": MaintNotificationsConfig(enabled=False),
        "max_connections": CALLS_MAX + SPARE,
        "timeout": settings.timeout,  # the pool's wait for a free connection
    }
    secret = password(settings, os.environ if environ is None else environ)
    if secret is not None:
        options["password"] = secret
    driver = driver_info()
    if driver is not None:
        options["driver_info"] = driver
    return Redis.from_pool(BlockingConnectionPool.from_url(settings.url, **options))


def driver_info() -> Any | None:
    """What each new connection tells Redis of its library (``CLIENT SETINFO``), built once
    here; None with a redis-py that has no ``DriverInfo`` (an older one reads its version
    once, at import). Left to redis-py, every new connection builds its own and reads the
    package's metadata for it (``importlib.metadata.version``: a walk of ``sys.path``, 0.3 to
    7 ms on the loop), so a burst of new connections after a stall stalled the loop again."""
    try:
        from redis.driver_info import DriverInfo
    except ImportError:
        return None
    return DriverInfo()


def out_of_memory() -> type[BaseException]:
    """What a call to the client raises when Redis refuses a write at its ``maxmemory``."""
    from redis.exceptions import OutOfMemoryError

    return OutOfMemoryError


def failures() -> tuple[type[BaseException], ...]:
    """What a call to the client raises when Redis cannot answer."""
    from redis.exceptions import RedisError

    return (RedisError, OSError, TimeoutError, BadReply)


async def ping(client: Redis) -> object:
    """One PING: what ``links.FleetLinks.probe`` asks a link shown unreachable."""
    answer: object = await client.ping()
    return answer


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


def describe(exc: BaseException) -> tuple[str, str]:
    """A failure's kind (its class: one warning per kind) and its text, Redis's own words."""
    kind = type(exc).__name__
    if kind == "TimeoutError":  # asyncio's or redis-py's
        return kind, "did not answer in time"
    return kind, f"{str(exc) or kind} ({kind})"


async def cancellable(aw: Awaitable[T]) -> T:
    """``await aw``, and ``CancelledError`` when the task was asked to stop meanwhile, however
    ``aw`` ended. redis-py (8.x) swallows a cancellation that lands in parts of a command (the
    connection's release, a reply read), returning a result or raising its own error instead,
    and the task would run on: a periodic task looping past a stop, a shutdown waiting for it
    forever (a sidecar stopped while its DLQ counts were read never exited on SIGTERM).
    ``asyncio.timeout`` takes back its own cancellations, so a count above the one at the
    start is a request from outside. Every await on the client goes through this."""
    task = asyncio.current_task()
    asked = task.cancelling() if task is not None else 0
    try:
        return await aw
    finally:
        if task is not None and task.cancelling() > asked:
            raise asyncio.CancelledError  # the stop wins over any result


class FleetLink:
    """One client of the fleet's Redis with its pause after failures: every call bounded by
    ``timeout``, a failure a ``FleetUnavailable``."""

    def __init__(
        self,
        settings: FleetRedis,
        clock: Clock,
        environ: Mapping[str, str] | None = None,
        *,
        use: str = "",
    ) -> None:
        self.client = make_client(settings, environ)
        self.use = use  # what this link is for, named by the use that makes it
        self.prefix = settings.key_prefix
        self.timeout = settings.timeout
        self.backoff = ReconnectPause()
        self.errors = ErrorReport(subject=f"the fleet Redis ({use})" if use else "the fleet Redis")
        self.closed = False
        self._clock = clock
        self._failures = failures()
        self._full = out_of_memory()
        self._slots = asyncio.Semaphore(CALLS_MAX)

    @property
    def connected(self) -> bool:
        return self.backoff.connected

    def may_try(self) -> bool:
        """Whether a call now would be sent (no pause after a failure, or the pause is over)."""
        return self.backoff.ready(self._clock.monotonic())

    @property
    def last_error(self) -> str | None:
        """The text of the failure that made the link unreachable; None while connected."""
        return None if self.connected else self.errors.last

    async def call(self, fn: Callable[[Redis], Awaitable[T]]) -> T:
        """``fn(client)`` within ``timeout`` (the wait for a free slot included);
        ``FleetUnavailable`` when Redis cannot answer, is in its pause, or no slot came free in
        time; ``FleetFull`` (one) when Redis refused a write with ``OOM``. A cancelled call,
        one that found no slot, or one refused with ``OOM`` is no failure of Redis's."""
        now = self._clock.monotonic()
        if not self.backoff.ready(now):
            wait = self.backoff.next_try - now
            raise FleetUnavailable(
                f"the fleet Redis is unreachable: {self.errors.last or 'failed'} "
                f"(next try in {wait:.1f}s)"
            )
        deadline = asyncio.get_running_loop().time() + self.timeout
        slots = self._slots
        if slots.locked():  # a free slot is taken without waiting: no timeout to arm for it
            try:
                async with asyncio.timeout_at(deadline):
                    await slots.acquire()
            except TimeoutError:
                raise FleetUnavailable(
                    f"no connection to the fleet Redis came free in time ({CALLS_MAX} calls "
                    "in flight)"
                ) from None
        else:
            await slots.acquire()
        try:
            async with asyncio.timeout_at(deadline):
                result = await cancellable(fn(self.client))
        except self._full as exc:  # Redis answered: its memory is full, the link is fine
            self._answered()
            raise FleetFull(f"the fleet Redis is at its maxmemory: {exc}") from None
        except self._failures as exc:
            raise self._failed(exc) from None
        finally:
            slots.release()
        self._answered()
        return result

    def _answered(self) -> None:
        self.backoff.succeeded()
        if self.errors.last is not None:
            told = self.errors.succeeded()
            if told is not None:
                log.info(told)

    def _failed(self, exc: BaseException) -> FleetUnavailable:
        now = self._clock.monotonic()
        self.backoff.failed(now)
        kind, text = describe(exc)
        warning = self.errors.failed(kind, text, now)
        if warning is not None:
            log.warning(warning)
        return FleetUnavailable(f"the fleet Redis is unreachable: {text}")

    async def open_connections(self, count: int = CALLS_MAX) -> int:
        """Open up to ``count`` of the pool's connections now (at start), within ``timeout``;
        how many are open. Each is given back to the pool whatever happens (a failure, a
        cancellation); one not opened now opens when a call needs it, as before. No call's
        failure: it starts no pause and warns nothing (the first call does, if Redis is down)."""
        pool = self.client.connection_pool
        taken: list[Any] = []

        async def take() -> None:
            taken.append(await pool.get_connection())  # type: ignore[no-untyped-call]

        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.gather(*(take() for _ in range(count)), return_exceptions=True)
        except TimeoutError:
            pass
        finally:
            for connection in taken:
                await pool.release(connection)
        return len(taken)

    async def close(self) -> None:
        self.closed = True
        await self.client.aclose()

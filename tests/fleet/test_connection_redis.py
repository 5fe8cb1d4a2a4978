"""The fleet's Redis link against a real redis-server (tests/redisserver.py), under asyncio and
uvloop: idle connections that a Redis restart closed are replaced before a command is sent on
them; a burst of calls beyond the pool waits for a connection within its timeout during a stall
shorter than it; a local shortage of connections starts no pause; a Redis that refuses (a wrong
password, no such database, a refused connection) is a warning in the log with its own words,
once per kind per 30 s, and its text is what the link says while it is unreachable."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import random
from typing import Any

import pytest
from redis.asyncio import Redis

from sidecar.config.fleet import FleetRedis
from sidecar.fleet.connection import BACKOFF_MAX, CALLS_MAX, FleetLink, FleetUnavailable
from sidecar.fleet.report import REPORT_EVERY
from sidecar.testing import FakeClock
from tests.idempotency import test_idempotency_store as contract
from tests.idempotency.test_idempotency_store import Run
from tests.proc import free_port
from tests.redisserver import RedisServer
from tests.wait import until

run = contract.run  # the fixture: each test under asyncio and uvloop


def link_to(
    url: str, clock: FakeClock, timeout: float = 5.0, env: dict[str, str] | None = None
) -> FleetLink:
    """Made inside the loop that uses it (its connections belong to that loop)."""
    env = env or {}
    password_env = "PW" if env else None
    return FleetLink(FleetRedis(url, "t:", password_env, timeout), clock, env)


def test_idle_connections_a_redis_restart_closed_are_replaced_before_a_command(
    run: Run, redis: RedisServer
) -> None:
    async def main() -> None:
        link = link_to(redis.url, FakeClock())
        gate = asyncio.Event()

        async def held(r: Redis) -> object:  # several pooled connections, each used once
            await gate.wait()
            return await r.incr("n")

        try:
            calls = [asyncio.create_task(link.call(held)) for _ in range(8)]
            gate.set()
            await asyncio.gather(*calls)
            # SIGTERM (the AOF keeps "n"), then the same port; the loop runs meanwhile, so the
            # pooled connections see the old server close them while they are idle.
            await asyncio.to_thread(redis.stop)
            await asyncio.to_thread(redis.start)
            gate.clear()
            calls = [asyncio.create_task(link.call(held)) for _ in range(8)]
            gate.set()
            got = await asyncio.gather(*calls)
            assert sorted(got) == list(range(9, 17))  # type: ignore[type-var]
            assert link.connected and link.last_error is None
        finally:
            await link.close()

    run(main)


def test_a_burst_beyond_the_pool_during_a_short_stall_waits_for_a_connection(
    run: Run, redis: RedisServer
) -> None:
    async def main() -> None:
        link = link_to(redis.url, FakeClock(), timeout=30.0)  # the stall ends well within it
        burst = CALLS_MAX + 50
        entered = 0

        async def incr(r: Redis) -> object:
            nonlocal entered
            entered += 1
            return await r.incr("n")

        try:
            await link.call(lambda r: r.ping())
            redis.pause()
            calls = [asyncio.create_task(link.call(incr)) for _ in range(burst)]
            await until(lambda: entered >= CALLS_MAX, "the first calls to reach the stalled Redis")
            # Checks that nothing fails while Redis is stalled (a pool that is out of
            # connections fails at once): give every call its turn to.
            await asyncio.sleep(0.2)
            assert not any(c.done() for c in calls)
            redis.resume()
            got = await asyncio.gather(*calls)
            assert sorted(got) == list(range(1, burst + 1))  # type: ignore[type-var]
            assert link.connected
        finally:
            redis.resume()
            await link.close()

    run(main)


def test_a_burst_of_new_connections_reads_no_package_metadata_on_the_loop(
    run: Run, redis: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py 7.1+ built a ``DriverInfo`` per new connection, reading the package's version
    with ``importlib.metadata`` (a walk of ``sys.path``, 0.3-7 ms on the loop each): a burst of
    new connections after a stall stalled the loop again. The link builds it once; each
    connection still tells Redis its library (``CLIENT SETINFO``)."""
    import redis as redis_py

    async def main() -> None:
        link = link_to(redis.url, FakeClock())
        reads: list[str] = []
        version = importlib.metadata.version

        def counted(name: str) -> str:
            reads.append(name)
            return version(name)

        monkeypatch.setattr(importlib.metadata, "version", counted)
        gate = asyncio.Event()
        opened = 8

        async def held(r: Redis) -> object:  # each call on a connection of its own
            await gate.wait()
            return await r.client_info()

        try:
            calls = [asyncio.create_task(link.call(held)) for _ in range(opened)]
            await asyncio.sleep(0)  # every call has taken its connection
            gate.set()
            infos = await asyncio.gather(*calls)
            assert len({info["id"] for info in infos}) == opened  # type: ignore[index]
            assert reads == []
            # What CLIENT SETINFO sends (Redis 7.2+ records it; 7.0 ignores it).
            pool: Any = link.client.connection_pool
            sent = {c.driver_info.lib_version for c in pool._available_connections}
            assert sent == {redis_py.__version__}
        finally:
            await link.close()

    run(main)


def test_no_free_connection_within_the_timeout_is_no_failure_of_redis(
    run: Run, redis: RedisServer
) -> None:
    async def main() -> None:
        clock = FakeClock()
        link = link_to(redis.url, clock, timeout=30.0)  # the holders': past the test's end
        gate = asyncio.Event()
        holding = 0

        async def hold(r: Redis) -> None:
            nonlocal holding
            holding += 1
            await gate.wait()

        held = [asyncio.create_task(link.call(hold)) for _ in range(CALLS_MAX)]
        try:
            await until(lambda: holding == CALLS_MAX, "every slot taken")
            link.timeout = 0.3  # the next call's bound: it ends while every slot is still held
            with pytest.raises(FleetUnavailable, match="no connection to the fleet Redis came"):
                await link.call(lambda r: r.ping())
            assert link.connected and link.backoff.ready(clock.monotonic())  # no pause
            gate.set()
            await asyncio.gather(*held)
            assert await link.call(lambda r: r.ping()) is True
        finally:
            gate.set()
            await link.close()

    run(main)


def _refusing(redis: RedisServer, kind: str) -> tuple[str, dict[str, str], str]:
    """A link's URL and environment that ``redis`` refuses, and what Redis says."""
    if kind == "password":
        import redis as redis_py

        admin = redis_py.Redis(port=redis.port)
        admin.config_set("requirepass", "right")
        admin.close()
        return redis.url, {"PW": "wrong"}, "invalid username-password pair"
    if kind == "database":
        return f"redis://127.0.0.1:{redis.port}/16", {}, "DB index is out of range"
    return f"redis://127.0.0.1:{free_port()}/0", {}, "Error 111 connecting"


@pytest.mark.parametrize("kind", ["password", "database", "refused"])
def test_a_redis_that_refuses_is_a_warning_with_its_words_once_per_kind_per_30s(
    run: Run, redis: RedisServer, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    url, env, says = _refusing(redis, kind)

    async def main() -> None:
        clock = FakeClock()
        link = link_to(url, clock, env=env)
        try:
            for _ in range(5):
                with pytest.raises(FleetUnavailable, match=says):
                    await link.call(lambda r: r.ping())
                assert not link.connected and says in (link.last_error or "")
                with pytest.raises(FleetUnavailable, match=says):  # in the pause: still says
                    await link.call(lambda r: r.ping())
                clock.advance(BACKOFF_MAX)
            clock.advance(REPORT_EVERY)
            with pytest.raises(FleetUnavailable):
                await link.call(lambda r: r.ping())
        finally:
            await link.close()

    with caplog.at_level(logging.WARNING, logger="sidecar.fleet"):
        run(main)
    warned = [r.getMessage() for r in caplog.records if r.name == "sidecar.fleet"]
    assert len(warned) == 2 and all(says in w for w in warned), warned
    assert "(4 more like it since the last warning)" in warned[1]


def test_a_cancellation_always_stops_the_task_that_calls_redis(
    run: Run, redis: RedisServer
) -> None:
    """A task calling Redis in a loop and cancelled at a random moment ends with
    ``CancelledError``, every time. redis-py swallows a cancellation that lands in parts of a
    command (about half of 200 such cancellations, measured, returned normally or raised its
    own error), so a periodic task ran on past its stop and a sidecar stopped right after it
    started hung on SIGTERM until it was killed."""

    async def main() -> None:
        link = link_to(redis.url, FakeClock())
        rng = random.Random(29)
        calls_made = 0

        stop = False

        async def loop() -> None:
            nonlocal calls_made
            while not stop:
                with contextlib.suppress(FleetUnavailable):
                    await link.call(lambda r: r.hgetall("h"))
                calls_made += 1

        try:
            for i in range(100):
                task = asyncio.create_task(loop())
                await asyncio.sleep(rng.random() * 0.005)
                task.cancel()
                done, _ = await asyncio.wait({task}, timeout=5.0)
                if not done:  # swallowed: the task loops on
                    stop = True
                    await task
                    pytest.fail(f"cancellation {i + 1} was swallowed: the task ran on")
                assert task.cancelled()
            assert calls_made > 0
        finally:
            await link.close()

    run(main)

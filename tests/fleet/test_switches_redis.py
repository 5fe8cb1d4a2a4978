"""Fleet kill switches' writes against a real redis-server, under asyncio and uvloop: a reader
that judged a switch expired does not delete the switch set again in the meantime, and a set
or a lift refused as "nothing changed" (Redis paused past the timeout) changes nothing when
Redis resumes, whether the write was stuck before or after its deadline was read from Redis."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis as redis_py
from redis.asyncio import Redis

from sidecar.config.fleet import FleetRedis
from sidecar.fleet.connection import FleetLink, FleetUnavailable
from sidecar.fleet.switches import FleetSwitch, FleetSwitches, deadline
from sidecar.testing import FakeClock
from tests.idempotency import test_idempotency_store as contract
from tests.idempotency.test_idempotency_store import Run
from tests.redisserver import RedisServer

run = contract.run  # the fixture: each test under asyncio and uvloop
HASH = "t:killswitches"


def switches(redis: RedisServer, clock: FakeClock, name: str, timeout: float) -> FleetSwitches:
    link = FleetLink(FleetRedis(redis.url, "t:", None, timeout), clock, {})
    return FleetSwitches(link, clock, name)


def held(redis: RedisServer) -> dict[bytes, bytes]:
    """The shared hash as Redis holds it now, read on a connection of its own."""
    with redis_py.Redis(port=redis.port) as r:
        got: dict[bytes, bytes] = r.hgetall(HASH)
        return got


def test_the_deadline_leaves_one_round_trip_before_the_caller_gives_up() -> None:
    # TIME read between 10.0 and 10.2 (local) said 500.0; the caller gives up at 11.0.
    assert deadline(500.0, 10.0, 10.2, 11.0) == pytest.approx(500.0 + 0.8 - 0.2)


def test_a_reader_never_deletes_a_switch_set_again_after_it_read_the_old_one(
    run: Run, redis: RedisServer
) -> None:
    async def main() -> None:
        clock = FakeClock(wall=1000.0)
        reader = switches(redis, clock, "pod-a", 5.0)
        writer = switches(redis, clock, "pod-b", 5.0)
        short = FleetSwitch("global", "oops: 1ms", "10.0.0.1", "pod-b", 990.0, 999.0)
        fresh = FleetSwitch("global", "meant 15m", "10.0.0.1", "pod-b", 1000.0, 1900.0)
        calls = 0
        call = reader.link.call

        async def between(fn: Callable[[Redis], Awaitable[Any]]) -> Any:
            """The reader's calls; right after its read, the scope is set again."""
            nonlocal calls
            calls += 1
            got = await call(fn)
            if calls == 1:
                await writer.set(fresh)
            return got

        try:
            await writer.set(short)  # already expired at the readers' wall clock
            reader.link.call = between  # type: ignore[method-assign]
            await reader.read()
            assert calls == 2  # the read, then the delete of what it judged expired
            assert held(redis) == {b"global": fresh.encode()}
            reader.link.call = call  # type: ignore[method-assign]
            await reader.read()
            assert [sw.reason for sw in reader.active(clock.wall())] == ["meant 15m"]
        finally:
            await reader.link.close()
            await writer.link.close()

    run(main)


@pytest.mark.parametrize("stuck", ["before its deadline was read", "after"])
def test_a_set_and_a_lift_refused_while_redis_was_paused_change_nothing_when_it_resumes(
    run: Run, redis: RedisServer, stuck: str
) -> None:
    async def main() -> None:
        clock = FakeClock(wall=1000.0)
        fleet = switches(redis, clock, "pod-a", 0.3)
        kept = FleetSwitch("route:orders", "kept", "10.0.0.1", "pod-a", 1000.0, 1900.0)
        refused = FleetSwitch("global", "refused", "10.0.0.1", "pod-a", 1000.0, 1900.0)
        client = fleet.link.client
        time = client.time

        async def time_then_pause(**kwargs: Any) -> Any:
            """Redis's clock is read; Redis stalls right after, with the write still to come."""
            got = await time(**kwargs)
            redis.pause()
            return got

        try:
            await fleet.set(kept)
            for attempt in (lambda: fleet.set(refused), lambda: fleet.lift(kept.scope)):
                if stuck == "after":
                    client.time = time_then_pause  # type: ignore[method-assign]
                else:
                    redis.pause()
                with pytest.raises(FleetUnavailable, match="did not answer in time"):
                    await attempt()
                client.time = time  # type: ignore[method-assign]
                redis.resume()
                # What the paused Redis had been sent, it runs now, before it answers a
                # connection opened after it resumed.
                assert held(redis) == {b"route:orders": kept.encode()}
                clock.advance(10.0)  # past the link's pause
        finally:
            redis.resume()
            await fleet.link.close()

    run(main)

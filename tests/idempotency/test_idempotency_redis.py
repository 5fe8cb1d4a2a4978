"""The fleet's Redis idempotency store against a real redis-server (tests/redisserver.py):
what it adds to the contract tests it shares with SQLite (test_idempotency_store.py): a Redis
killed and restarted keeps every answer acknowledged before (AOF, fsync always), a paused Redis
is a bounded ``StoreError`` and the store asks it again by itself, and a claim that timed out
or was cancelled after it was sent is undone. Under asyncio and uvloop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from redis.asyncio.client import Pipeline

from sidecar.config.fleet import FleetRedis
from sidecar.fleet.connection import BACKOFF_MAX, FleetLink
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.redisstore import RedisIdempotencyStore
from sidecar.idempotency.store import Busy, Claimed, Finished, StoreError
from sidecar.testing import FakeClock
from tests.idempotency import test_idempotency_store as contract
from tests.idempotency.test_idempotency_store import Run, redis_store
from tests.redisserver import RedisServer, running
from tests.wait import until_async

run = contract.run  # the fixture: each test under asyncio and uvloop
ANSWER = KeptAnswer(200, ((b"Content-Type", b"text/plain"),), b"kept")


def test_answers_acknowledged_before_a_sigkill_survive_the_restart(
    run: Run,
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    with running(tmp_path / "redis") as server:

        async def before() -> None:
            store = redis_store(server.url, clock)
            try:
                for i in range(20):
                    claim = await store.claim(f"k{i}", "fp", 30.0)
                    assert isinstance(claim, Claimed)
                    assert await store.complete(f"k{i}", claim.token, ANSWER, 3600.0)
            finally:
                await store.close()

        run(before)
        server.restart()  # SIGKILL right after the last acknowledgement, then the same files

        async def after() -> None:
            store = redis_store(server.url, clock)
            try:
                for i in range(20):
                    got = await store.claim(f"k{i}", "fp", 30.0)
                    assert isinstance(got, Finished) and got.record.answer == ANSWER
            finally:
                await store.close()

        run(after)


class PausingClock(FakeClock):
    """Pauses the Redis the moment a claim has read the key and the server's time, and decided
    (``decided``, called by ``PausingStore``): its ``MULTI``/``EXEC`` then goes to a Redis that
    answers nothing."""

    def __init__(self, server: RedisServer) -> None:
        super().__init__()
        self.server = server
        self.armed = False
        self.paused = asyncio.Event()

    def decided(self) -> None:
        if self.armed:
            self.armed = False
            self.server.pause()
            self.paused.set()


class PausingStore(RedisIdempotencyStore):
    def __init__(self, url: str, clock: PausingClock, timeout: float) -> None:
        settings = FleetRedis(url=url, key_prefix="test:", password_env=None, timeout=timeout)
        super().__init__(FleetLink(settings, clock), clock)
        self.pausing = clock

    async def _server_now(self, pipe: Pipeline) -> float:
        now = await super()._server_now(pipe)
        self.pausing.decided()
        return now


@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_claim_cut_off_after_it_was_sent_is_undone(
    run: Run,
    tmp_path: Path,
    how: str,
) -> None:
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            clock = PausingClock(server)
            clock.paused = asyncio.Event()  # of this loop
            store = PausingStore(server.url, clock, timeout=0.3)
            try:
                clock.armed = True
                task = asyncio.ensure_future(store.claim("k", "fp", 30.0))
                await clock.paused.wait()
                if how == "cancel":
                    for _ in range(20):  # let the transaction be written to the socket
                        await asyncio.sleep(0)
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                else:
                    with pytest.raises(StoreError, match="did not answer in time"):
                        await task
                server.resume()  # the claim lands now, if it reached Redis at all

                async def gone() -> bool:
                    clock.advance(BACKOFF_MAX)  # the link's pause after the failure is over
                    try:
                        return await store.get("k") is None
                    except StoreError:
                        return False

                await until_async(gone, "the cut-off claim released")
                assert isinstance(await store.claim("k", "fp", 30.0), Claimed)
            finally:
                server.resume()
                await store.close()

        run(main)


def test_a_paused_redis_is_a_bounded_store_error_then_asked_again(
    run: Run,
    tmp_path: Path,
) -> None:
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            clock = FakeClock()
            store = redis_store(server.url, clock, timeout=0.2)
            try:
                assert isinstance(await store.claim("a", "fp", 30.0), Claimed)
                server.pause()
                with pytest.raises(StoreError, match="did not answer in time"):
                    await store.claim("b", "fp", 30.0)
                assert not store.connected
                with pytest.raises(StoreError, match="next try in"):  # in the pause: at once
                    await store.claim("b", "fp", 30.0)
                server.resume()

                async def back() -> bool:
                    clock.advance(BACKOFF_MAX)
                    try:
                        return isinstance(await store.claim("b", "fp", 30.0), Claimed)
                    except StoreError:
                        return False

                await until_async(back, "the store reconnected")
                assert store.connected
            finally:
                server.resume()
                await store.close()

        run(main)


def test_leases_and_ttls_are_judged_on_the_servers_clock_not_the_replicas(
    run: Run,
    tmp_path: Path,
) -> None:
    """Two replicas whose wall clocks disagree (b a day ahead, c a day behind): b never takes a
    live lease over, nor sees a kept answer as expired; c's Retry-After is told on its clock."""
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            a_clock = FakeClock()
            b_clock = FakeClock(wall=a_clock.wall() + 86_400 * 2)
            c_clock = FakeClock(wall=a_clock.wall() - 86_400)
            a = redis_store(server.url, a_clock)
            b = redis_store(server.url, b_clock)
            c = redis_store(server.url, c_clock)
            try:
                claim = await a.claim("k", "fp", 30.0)
                assert isinstance(claim, Claimed)
                busy = await b.claim("k", "fp", 30.0)
                assert isinstance(busy, Busy) and 0 < busy.expiry - b_clock.wall() <= 30.0
                assert await a.renew("k", claim.token, 30.0)
                busy = await c.claim("k", "fp", 30.0)
                assert isinstance(busy, Busy) and 0 < busy.expiry - c_clock.wall() <= 30.0
                assert await a.complete("k", claim.token, ANSWER, 3600.0)
                replay = await b.claim("k", "fp", 30.0)
                assert isinstance(replay, Finished) and replay.record.answer == ANSWER
            finally:
                for store in (a, b, c):
                    await store.close()

        run(main)


def test_a_lease_renewed_holds_and_one_run_out_on_the_servers_clock_is_taken_over(
    run: Run,
    tmp_path: Path,
) -> None:
    """The lease contract on Redis's own clock (the replica's stands still here): renewed, it
    holds; left, it runs out and is taken over, and the dead holder's late answer is refused."""
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            store = redis_store(server.url, FakeClock())
            try:
                dead = await store.claim("k", "fp", 0.2)
                assert isinstance(dead, Claimed)
                assert await store.renew("k", dead.token, 60.0)
                assert isinstance(await store.claim("k", "fp", 0.2), Busy)
                assert await store.renew("k", dead.token, 0.2)  # then no more heartbeats

                async def taken() -> bool:
                    got = await store.claim("k", "fp", 60.0)
                    return isinstance(got, Claimed) and got.took_over

                await until_async(taken, "the lease to run out on Redis's clock")
                assert not await store.complete("k", dead.token, ANSWER, 60.0)
                assert not await store.renew("k", dead.token, 60.0)
            finally:
                await store.close()

        run(main)

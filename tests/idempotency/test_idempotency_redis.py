"""The fleet's Redis idempotency store against a real redis-server (tests/redisserver.py):
what it adds to the contract tests it shares with SQLite (test_idempotency_store.py): a Redis
killed and restarted keeps every answer acknowledged before (AOF, fsync always), a paused Redis
is a bounded ``StoreError`` and the store asks it again by itself, and a claim that timed out
or was cancelled after it was sent is undone. Under asyncio and uvloop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sidecar.fleet.connection import BACKOFF_MAX
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.store import Claimed, Finished, StoreError
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
    """Pauses the Redis the moment a claim has read the key and decided (``wall``): its
    ``MULTI``/``EXEC`` then goes to a Redis that answers nothing."""

    def __init__(self, server: RedisServer) -> None:
        super().__init__()
        self.server = server
        self.armed = False
        self.paused = asyncio.Event()

    def wall(self) -> float:
        if self.armed:
            self.armed = False
            self.server.pause()
            self.paused.set()
        return super().wall()


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
            store = redis_store(server.url, clock, timeout=0.3)
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

"""The keys a process holds and the settlements it carries on (``idempotency/holding.py``),
through the guard: a settlement the store failed (a Redis stall as the app answers) lands later
in the background, the key held and its lease renewed meanwhile (409 to a duplicate), and a
duplicate then gets the kept answer; the retrier cancelled half-way at stop leaves nothing; a
key held by a live request of this process is never taken over, whatever the wall clock says.
Against a real redis-server and the real SQLite store, under asyncio and uvloop."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from sidecar.core import Clock
from sidecar.idempotency.answer import Forwarded
from sidecar.idempotency.fingerprint import NO_SCOPE, stored_key
from sidecar.idempotency.guard import guarded
from sidecar.idempotency.holding import RETRIER_TASK, Holdings, retry_delay
from sidecar.idempotency.outcome import IdempotencyOutcome as O
from sidecar.testing import FakeClock
from tests.idempotency import test_idempotency_guard as g
from tests.idempotency.test_idempotency_store import opened, redis_store
from tests.redisserver import running
from tests.wait import until, until_async

run = g.run  # the fixture: each test under asyncio and uvloop
SKEY = stored_key("k1", NO_SCOPE, "orders")


def test_retry_delay_doubles_and_stays_within_a_third_of_the_lease() -> None:
    assert [retry_delay(n, 7.0) for n in (1, 2, 3, 4, 5, 6)] == [0.1, 0.2, 0.4, 0.8, 1.6, 7 / 3]
    assert retry_delay(9, 0.03) == 0.1


def _retriers() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name() == RETRIER_TASK]


def test_a_complete_a_stalled_redis_failed_lands_later_and_a_duplicate_is_replayed(
    run: g.Run, tmp_path: Path
) -> None:
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            clock = Clock()
            store = redis_store(server.url, clock, timeout=0.2)  # type: ignore[arg-type]
            holdings = Holdings(clock)
            app = g.App()

            async def stalls_as_it_answers() -> Forwarded:
                answer = await app.forward()
                server.pause()  # Redis stalls as the app answers: the complete times out
                return answer

            try:
                got = await guarded(
                    g.POLICY, store, g.view(), stalls_as_it_answers, clock, holdings=holdings
                )
                # The app acted: its answer goes out; the key is kept once the store takes it.
                assert got.outcome is O.STORE_ERROR and isinstance(got.answer, Forwarded)
                assert got.answer.status == 201 and holdings.retrying == 1
                dup = await guarded(
                    g.POLICY, store, g.view(), app.forward, clock, holdings=holdings
                )
                assert dup.outcome is O.IN_PROGRESS and app.calls == 1
                server.resume()

                async def kept() -> bool:
                    try:
                        record = await store.get(SKEY)
                    except Exception:
                        return False
                    return record is not None and record.finished

                await until_async(kept, "the settlement handed to the retrier to land")
                await until(lambda: holdings.retrying == 0, "the retrier to end")
                assert holdings.held == frozenset() and holdings.given_up == 0
                again = await guarded(
                    g.POLICY, store, g.view(), app.forward, clock, holdings=holdings
                )
                assert again.outcome is O.REPLAYED and app.calls == 1
            finally:
                server.resume()
                await holdings.stop()
                await store.close()

        run(main)


def test_a_retrier_cancelled_half_way_at_stop_leaves_nothing(run: g.Run, tmp_path: Path) -> None:
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            clock = Clock()
            store = redis_store(server.url, clock, timeout=0.2)  # type: ignore[arg-type]
            holdings = Holdings(clock)
            app = g.App()

            async def stalls_as_it_answers() -> Forwarded:
                answer = await app.forward()
                server.pause()
                return answer

            try:
                got = await guarded(
                    g.POLICY, store, g.view(), stalls_as_it_answers, clock, holdings=holdings
                )
                assert got.outcome is O.STORE_ERROR and len(_retriers()) == 1
                await asyncio.sleep(0.3)  # half-way: a retry has failed, the next is pending
                await holdings.stop()
                assert _retriers() == [] and holdings.retrying == 0
                assert holdings.held == frozenset()
                server.resume()

                async def in_progress() -> bool:
                    try:
                        record = await store.get(SKEY)
                    except Exception:
                        return False
                    return record is not None and not record.finished

                # Left in progress until its lease, as a sidecar that stops with it.
                await until_async(in_progress, "the key to read back in progress")
            finally:
                server.resume()
                await holdings.stop()
                await store.close()

        run(main)


def test_a_wall_clock_step_never_takes_a_live_key_of_this_process_over(
    run: g.Run, tmp_path: Path
) -> None:
    async def main() -> None:
        clock = FakeClock()
        store = opened(tmp_path / "keys.db", clock)
        holdings = Holdings(clock)
        gate = asyncio.Event()
        app = g.App(gate=gate)
        try:
            first = asyncio.ensure_future(
                guarded(g.POLICY, store, g.view(), app.forward, clock, holdings=holdings)
            )
            await app.entered.wait()
            clock.step_wall(3600.0)  # an NTP step far past the lease; monotonic time stands
            dup = await guarded(g.POLICY, store, g.view(), app.forward, clock, holdings=holdings)
            assert dup.outcome is O.IN_PROGRESS and app.calls == 1
            other = g.view(body=b'{"n": 2}')
            assert (
                await guarded(g.POLICY, store, other, app.forward, clock, holdings=holdings)
            ).outcome is O.MISMATCH
            gate.set()
            assert (await first).outcome is O.FIRST and holdings.held == frozenset()
            again = await guarded(g.POLICY, store, g.view(), app.forward, clock, holdings=holdings)
            assert again.outcome is O.REPLAYED and app.calls == 1
        finally:
            store.close()

    run(main)


def test_a_request_cancelled_without_an_answer_lets_its_key_go(run: g.Run, tmp_path: Path) -> None:
    async def main() -> None:
        clock = FakeClock()
        store = opened(tmp_path / "keys.db", clock)
        holdings = Holdings(clock)
        app = g.App(gate=asyncio.Event())
        try:
            task = asyncio.ensure_future(
                guarded(g.POLICY, store, g.view(), app.forward, clock, holdings=holdings)
            )
            await app.entered.wait()
            assert holdings.held == frozenset({SKEY})
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert holdings.held == frozenset()
            clock.advance(g.POLICY.lease_for(60.0))  # the lease passes: taken over, as a dead one
            again = await guarded(
                g.POLICY, store, g.view(), g.App().forward, clock, holdings=holdings
            )
            assert again.outcome is O.LEASE_EXPIRED
        finally:
            store.close()

    run(main)

"""The fleet's Redis idempotency store against a real redis-server (tests/redisserver.py):
what it adds to the contract tests it shares with SQLite (test_idempotency_store.py): a Redis
killed and restarted keeps every answer acknowledged before (AOF, fsync always), a paused Redis
is a bounded ``StoreError`` and the store asks it again by itself, and a claim that timed out
or was cancelled after it was sent is undone. Under asyncio and uvloop."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.typing import EncodableT, FieldT

from sidecar.config.fleet import FleetRedis
from sidecar.fleet.connection import BACKOFF_MAX, FleetLink
from sidecar.idempotency.decision import Decision, KeyState, decide
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.redisstore import RedisIdempotencyStore
from sidecar.idempotency.store import Busy, Claimed, Finished, Mismatch, StoreError
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
    """Pauses the Redis the moment a claim is about to send its script (``sending``, called by
    ``PausingStore``) on a connection already open: the script then goes to a Redis that answers
    nothing, and runs when it resumes."""

    def __init__(self, server: RedisServer) -> None:
        super().__init__()
        self.server = server
        self.armed = False
        self.paused = asyncio.Event()

    def sending(self) -> None:
        if self.armed:
            self.armed = False
            self.server.pause()
            self.paused.set()


class PausingStore(RedisIdempotencyStore):
    def __init__(self, url: str, clock: PausingClock, timeout: float) -> None:
        settings = FleetRedis(url=url, key_prefix="test:", password_env=None, timeout=timeout)
        super().__init__(FleetLink(settings, clock), clock)
        self.pausing = clock

    async def _claim_round(self, client: Redis, names: list[str], args: list[str]) -> list[Any]:
        self.pausing.sending()
        return await super()._claim_round(client, names, args)


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
            watcher = Redis.from_url(server.url)
            try:
                # The connection open and the script known before the pause, so the claim
                # that is cut off is written whole and runs when Redis resumes.
                assert isinstance(await store.claim("warm", "fp", 30.0), Claimed)
                clock.armed = True
                task = asyncio.ensure_future(store.claim("k", "fp", 30.0))
                await clock.paused.wait()
                if how == "cancel":
                    for _ in range(20):  # let the script be written to the socket
                        await asyncio.sleep(0)
                    task.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await task
                else:
                    with pytest.raises(StoreError, match="did not answer in time"):
                        await task
                server.resume()  # the claim runs now

                async def ran_and_left_nothing() -> bool:
                    clock.advance(BACKOFF_MAX)  # the link's pause after the failure is over
                    stats = await watcher.info("commandstats")
                    if stats.get("cmdstat_evalsha", {}).get("calls", 0) < 2:  # warm, then k
                        return False
                    try:
                        return await store.get("k") is None
                    except StoreError:
                        return False

                await until_async(ran_and_left_nothing, "the cut-off claim ran, left no key")
                if how == "timeout":  # it ran past its deadline: it refused itself, wrote nothing
                    stats = await watcher.info("commandstats")
                    assert stats["cmdstat_hset"]["calls"] == 1  # the warm claim's only
                assert isinstance(await store.claim("k", "fp", 30.0), Claimed)
            finally:
                server.resume()
                await watcher.aclose()
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


# What a key may hold when a claim comes: nothing, or (finished, same fingerprint, seconds to
# its expiry on Redis's clock).
STATES: list[tuple[bool, bool, float] | None] = [
    None,
    *(
        (finished, same, offset)
        for finished in (False, True)
        for same in (True, False)
        for offset in (3600.0, -3600.0)
    ),
]
ANSWERED = {  # a claim's result, named by the decision that gives it
    Decision.FIRST: lambda got: isinstance(got, Claimed) and not got.took_over,
    Decision.LEASE_EXPIRED: lambda got: isinstance(got, Claimed) and got.took_over,
    Decision.IN_PROGRESS: lambda got: isinstance(got, Busy),
    Decision.MISMATCH: lambda got: isinstance(got, Mismatch),
    Decision.REPLAYED: lambda got: isinstance(got, Finished) and got.record.answer == ANSWER,
}


def test_the_claim_script_answers_what_decide_says_for_every_state(
    run: Run,
    tmp_path: Path,
) -> None:
    """The claim runs in Redis (a script) but ``decide`` is the one judgement: for every state
    a key may hold -- absent, in progress or finished, same or other request, live or past its
    expiry on Redis's clock -- the claim answers what ``decide`` says of that state, and a
    claim it grants holds the key for the new request."""
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            clock = FakeClock()
            store = redis_store(server.url, clock)
            raw = Redis.from_url(server.url)
            try:
                for i, shape in enumerate(STATES):
                    key = f"k{i}"
                    seconds, micros = await raw.time()
                    now = seconds + micros / 1_000_000
                    state = None
                    if shape is not None:
                        finished, same, offset = shape
                        state = KeyState(finished, "fp" if same else "other", now + offset)
                        await raw.hset(f"test:idem:{key}", mapping=held(state))
                    expected = decide(state, "fp", now)
                    got = await store.claim(key, "fp", 30.0)
                    assert ANSWERED[expected](got), (state, expected, got)
                    if isinstance(got, Claimed):
                        record = await store.get(key)
                        assert record is not None and not record.finished
                        assert record.fingerprint == "fp" and record.expires_at > now + 29
            finally:
                await raw.aclose()
                await store.close()

        run(main)


def held(state: KeyState) -> dict[FieldT, EncodableT]:
    """The hash of a key in ``state``, as the store writes it (a finished one with ANSWER)."""
    fields: dict[FieldT, EncodableT] = {
        "finished": "1" if state.finished else "0",
        "fingerprint": state.fingerprint,
        "token": "" if state.finished else "holder",
        "created_at": repr(state.expires_at - 60),
        "expires_at": repr(state.expires_at),
    }
    if state.finished:
        headers = [[k.decode(), v.decode()] for k, v in ANSWER.headers]
        fields.update(
            status=str(ANSWER.status), headers=json.dumps(headers), body=ANSWER.body or b"",
            kept="1", size="",
        )  # fmt: skip
    return fields


def test_concurrent_takeovers_of_one_run_out_lease_give_exactly_one_claim(
    run: Run,
    tmp_path: Path,
) -> None:
    """A takeover is judged here and written by a second script run only if the key still holds
    the state judged: of twenty claims racing from two replicas for a key whose holder's lease
    ran out, one takes it over and every other finds it held again."""
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            stores = [redis_store(server.url, FakeClock()) for _ in range(2)]
            raw = Redis.from_url(server.url)
            try:
                seconds, _ = await raw.time()
                dead = KeyState(False, "fp", seconds - 60.0)
                await raw.hset("test:idem:k", mapping=held(dead))
                claims = [stores[i % 2].claim("k", "fp", 30.0) for i in range(20)]
                got = await asyncio.gather(*claims)
                taken = [c for c in got if isinstance(c, Claimed)]
                assert len(taken) == 1 and taken[0].took_over
                assert all(isinstance(c, Busy) for c in got if c is not taken[0])
            finally:
                await raw.aclose()
                for store in stores:
                    await store.close()

        run(main)

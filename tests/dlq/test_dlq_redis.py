"""The DLQ store's contract on both backends (the SQLite file and the fleet's Redis, a real
redis-server from tests/redisserver.py), and what the Redis store adds: a record acknowledged
then Redis SIGKILLed and restarted is there (AOF, fsync always); a paused Redis is a bounded
``DlqUnavailable`` and the store asks it again by itself; a call cut off half-way (an add, a
claim) leaves nothing acknowledged that is not stored and no claim held; the start-up check of
``appendonly``/``appendfsync``. Under asyncio and uvloop."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from sidecar.config.fleet import FleetRedis
from sidecar.core import Clock
from sidecar.dlq import errors
from sidecar.dlq.contract import DlqStorage
from sidecar.dlq.operations import Finish
from sidecar.dlq.record import NewRecord
from sidecar.dlq.redisstore import RedisDlqStore
from sidecar.dlq.store import DlqStore
from sidecar.fleet import aof
from sidecar.fleet.connection import FleetLink
from sidecar.testing import FakeClock
from tests.fleet.test_dlq_fleet import client_list
from tests.idempotency import test_idempotency_store as idem
from tests.redisserver import RedisServer, running
from tests.wait import until, until_async

run = idem.run  # the fixture: each test under asyncio and uvloop
Run = idem.Run
NOW = 1_800_000_000.0
DELIVERED = Finish("delivered", True, 200, None, True)
PARKED = Finish("parked", True, 404, None, True, "the upstream answered 404")


def rec(route: str = "main", body: bytes = b"body", key: str | None = "k") -> NewRecord:
    return NewRecord(
        route, "PUT", "/o?x=1", [("X-Tenant", "acme")], body, "exhausted", 2, 503, None, key, NOW
    )


def redis_store(
    url: str, max_records: int = 1000, max_bytes: int = 10**7, timeout: float = 5.0
) -> RedisDlqStore:
    """Made inside the loop that uses it (its connections belong to that loop)."""
    link = FleetLink(FleetRedis(url=url, timeout=timeout), Clock())  # its pause runs out
    return RedisDlqStore(link, max_records, max_bytes, location=url)


Backend = Callable[..., Any]


@pytest.fixture(params=["sqlite", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    """``open_store(**bounds)``: an async context giving a store of the backend under test;
    several opened in one test share one file / one Redis, as several processes do."""
    if request.param == "sqlite":

        @asynccontextmanager
        async def sqlite(**bounds: int) -> AsyncIterator[DlqStorage]:
            s = DlqStore(str(tmp_path / "dlq.sqlite3"), bounds.get("max_records", 1000),
                         bounds.get("max_bytes", 10**7))  # fmt: skip
            s.open()
            try:
                yield s
            finally:
                s.close()

        yield sqlite
        return
    with running(tmp_path / "redis") as server:

        @asynccontextmanager
        async def redis(**bounds: int) -> AsyncIterator[DlqStorage]:
            s = redis_store(server.url, **bounds)
            try:
                yield s
            finally:
                await s.close()

        yield redis


def test_claims_are_exclusive_across_store_instances(run: Run, backend: Backend) -> None:
    async def main() -> None:
        async with backend() as a, backend() as b:
            ids = [await a.add(rec()) for _ in range(20)]

            async def try_claim(store: DlqStorage, owner: str, rid: str) -> str | None:
                try:
                    await store.claim(rid, owner, ("pending", "parked"), 60.0, NOW)
                except errors.RecordBusy:
                    return None
                return owner

            grants = await asyncio.gather(
                *(try_claim(s, o, r) for r in ids for s, o in ((a, "A"), (b, "B"), (a, "A2")))
            )
            trios = [grants[i : i + 3] for i in range(0, len(grants), 3)]
            assert all(sum(g is not None for g in trio) == 1 for trio in trios)
            for rid, trio in zip(ids, trios, strict=True):
                owner = next(g for g in trio if g is not None)
                store = b if owner == "B" else a
                assert not await (a if store is b else b).finish(rid, "nobody", DELIVERED, NOW)
                assert await store.finish(rid, owner, DELIVERED, NOW)
            for store in (a, b):
                with pytest.raises(errors.RecordDelivered):
                    await store.claim(ids[0], "late", ("pending", "parked"), 60.0, NOW + 10**6)
            with pytest.raises(errors.RecordNotFound):
                await a.claim("nope", "x", ("pending",), 60.0, NOW)
            got = await b.get(ids[3])
            assert got is not None and got["status"] == "delivered" and got["claimed_by"] is None

    run(main)


def test_bounds_refuse_new_records_and_keep_the_old(run: Run, backend: Backend) -> None:
    async def main() -> None:
        async with backend(max_records=2, max_bytes=10**6) as store:
            kept = [await store.add(rec()) for _ in range(2)]
            with pytest.raises(errors.DlqFull):
                await store.add(rec())
            # A delivered record no longer counts against the bounds.
            await store.claim(kept[0], "me", ("pending",), 60.0, NOW)
            assert await store.finish(kept[0], "me", DELIVERED, NOW)
            await store.add(rec())
            store.set_limits(100, 10)  # bytes now: refused, nothing dropped
            with pytest.raises(errors.DlqFull):
                await store.add(rec(body=b"x" * 100))
            rows, _ = await store.list(limit=10)
            assert len(rows) == 3

    run(main)


def test_list_pages_get_purge_and_prune(run: Run, backend: Backend) -> None:
    async def main() -> None:
        async with backend() as a, backend() as b:
            ids = [await a.add(rec("r1" if i % 2 else "r2", body=b"%d" % i)) for i in range(7)]
            seen: list[str] = []
            cursor = None
            while True:
                page, cursor = await b.list(limit=2, newest_first=False, cursor=cursor)
                seen += [r["id"] for r in page]
                if cursor is None:
                    break
            assert seen == ids  # oldest first, across routes, every record once
            newest, _ = await b.list(route="r1", limit=10)
            assert [r["id"] for r in newest] == [ids[5], ids[3], ids[1]]
            full = await b.get(ids[4])
            assert full is not None and full["body_bytes"] == b"4"
            assert full["headers"] == [["X-Tenant", "acme"]] and full["target"] == "/o?x=1"
            assert full["idempotency_key"] == "k" and full["last_status"] == 503
            assert full["reached_upstream"] is True and full["replays"] == 0
            await b.claim(ids[0], "me", ("pending",), 60.0, NOW)
            with pytest.raises(errors.RecordBusy):
                await a.delete(ids[0], now=NOW + 1)
            assert await b.finish(ids[0], "me", DELIVERED, NOW + 1)
            assert await a.delete(ids[1]) and not await a.delete(ids[1])
            parked, _ = await a.list(status="delivered")
            assert [r["id"] for r in parked] == [ids[0]]
            assert await a.prune_delivered(older_than=4_000_000_000.0) == 1
            assert await b.prune_delivered(older_than=4_000_000_000.0) == 0  # idempotent
            assert await a.get(ids[0]) is None
            left, _ = await a.list(limit=100)
            assert sorted(r["id"] for r in left) == sorted(ids[2:])
            counts = {(s, r): n for s, r, n, _ in await b.route_counts()}
            assert counts == {("pending", "r1"): 2, ("pending", "r2"): 3}

    run(main)


# -- what the Redis store adds ---------------------------------------------------------------


def test_records_acknowledged_before_a_sigkill_survive_the_restart(
    run: Run, tmp_path: Path
) -> None:
    with running(tmp_path / "redis") as server:

        async def before() -> list[str]:
            store = redis_store(server.url)
            try:
                return [await store.add(rec(body=b"%d" % i)) for i in range(20)]
            finally:
                await store.close()

        ids = run(before)
        server.restart()  # SIGKILL right after the last acknowledgement, then the same files

        async def after() -> None:
            store = redis_store(server.url)

            async def loaded() -> bool:  # a restarted Redis answers LOADING until its AOF is read
                try:
                    await store.get(ids[0])
                except errors.DlqUnavailable:
                    return False
                return True

            try:
                await until_async(loaded, "the restarted Redis to load its AOF")
                for i, rid in enumerate(ids):
                    got = await store.get(rid)
                    assert got is not None and got["body_bytes"] == b"%d" % i
                await store.refresh()
                assert store.counts.by_status["pending"] == 20
            finally:
                await store.close()

        run(after)


def test_a_paused_redis_is_unavailable_within_its_timeout_and_asked_again(
    run: Run, tmp_path: Path
) -> None:
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            store = redis_store(server.url, timeout=0.3)
            try:
                await store.add(rec())  # connected, scripts loaded
                server.pause()
                try:
                    with pytest.raises(errors.DlqUnavailable):
                        await store.add(rec())
                    assert not store.available
                finally:
                    server.resume()

                async def stored() -> bool:
                    try:
                        await store.add(rec())
                    except errors.DlqUnavailable:
                        return False
                    return True

                await until_async(stored, "the store to take records again")
                assert store.available
            finally:
                await store.close()

        run(main)


async def _sent(store: RedisDlqStore) -> None:
    """Until a command of the store is in flight on one of its connections."""
    pool: Any = store.link.client.connection_pool
    await until(lambda: pool._in_use_connections, "a command in flight")


def _consistent(server: RedisServer) -> Callable[[], Awaitable[None]]:
    """The counts in Redis agree with the records it holds (nothing counted that is not
    stored, nothing stored uncounted)."""

    async def check() -> None:
        store = redis_store(server.url)
        try:
            await store.refresh()
            listed, _ = await store.list(limit=1000)
            by: dict[str, int] = {}
            for r in listed:
                by[r["status"]] = by.get(r["status"], 0) + 1
            assert {k: v for k, v in store.counts.by_status.items() if v} == by
        finally:
            await store.close()

    return check


def test_an_add_cut_off_after_it_was_sent_is_never_acknowledged(run: Run, tmp_path: Path) -> None:
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            store = redis_store(server.url)
            try:
                await store.add(rec())
                server.pause()
                try:
                    adding = asyncio.ensure_future(store.add(rec()))
                    await _sent(store)
                    adding.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await adding  # the caller was not told "stored"
                finally:
                    server.resume()
                await store.add(rec())  # the store goes on
            finally:
                await store.close()
            await _consistent(server)()

        run(main)


def test_a_claim_whose_caller_was_cancelled_is_given_back(run: Run, tmp_path: Path) -> None:
    """The replayer's claim runs on while Redis is paused; its caller is cancelled; once the
    claim is granted it is released, and anyone may claim the record."""
    from sidecar.dlq.replay import Replayer

    with running(tmp_path / "redis") as server:

        async def main() -> None:
            store = redis_store(server.url)
            try:
                rid = await store.add(rec())
                fut = store.claim(rid, "warm-up", ("pending",), 60.0, NOW)
                await fut
                await store.release(rid, "warm-up", False)
                replayer = Replayer(store, None, None, owner="me")  # type: ignore[arg-type]
                server.pause()
                try:
                    claiming = asyncio.ensure_future(replayer._claim(rid, ("pending",), 60.0))
                    await _sent(store)
                    claiming.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await claiming
                finally:
                    server.resume()

                async def released() -> bool:
                    got = await store.get(rid)
                    return got is not None and got["claimed_by"] is None and got["replays"] == 0

                await until_async(released, "the claim given back")
                taken = await store.claim(rid, "other", ("pending",), 60.0, NOW)
                assert taken["claimed_by"] == "other"
            finally:
                await store.close()

        run(main)


def test_an_expired_claim_is_taken_over_on_redis_s_clock(run: Run, tmp_path: Path) -> None:
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            store = redis_store(server.url)
            try:
                rid = await store.add(
                    NewRecord(
                        "main", "POST", "/o", [], b"b", "exhausted", 1, 503, None, None, NOW, False
                    )
                )
                # The caller's ``now`` is far in the future: Redis's clock decides.
                await store.claim(rid, "dead", ("pending",), 0.5, NOW)
                with pytest.raises(errors.RecordBusy):
                    await store.claim(rid, "other", ("pending",), 60.0, NOW + 10**6)

                async def taken() -> bool:
                    try:
                        got = await store.claim(rid, "other", ("pending",), 60.0, NOW)
                    except errors.RecordBusy:
                        return False
                    assert got["reached_upstream"] is True  # possibly sent by the dead one
                    return True

                await until_async(taken, "the lease to run out")
                assert not await store.finish(rid, "dead", DELIVERED, NOW)
                assert await store.finish(rid, "other", DELIVERED, NOW)
            finally:
                await store.close()

        run(main)


def test_a_finish_sent_again_after_its_reply_was_lost_is_recognised(
    run: Run, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A finish times out in the sidecar (Redis paused) but Redis runs it when it resumes;
    the replayer's next try of that finish is its own earlier success: True, nothing changed
    twice, no ERROR line. A claim really lost (another owner took the record over) is still
    False and still logged."""
    from sidecar.dlq.replay import Replayer, ReplayOutcome

    with running(tmp_path / "redis") as server:

        async def main() -> None:
            store = redis_store(server.url, timeout=0.3)
            try:
                warm = await store.add(rec())  # the scripts loaded (EVALSHA finds them)
                await store.claim(warm, "me", ("pending",), 60.0, NOW)
                await store.finish(warm, "me", DELIVERED, NOW)
                rid = await store.add(rec())
                await store.claim(rid, "me", ("pending",), 60.0, NOW)
                server.pause()
                try:
                    with pytest.raises(errors.DlqUnavailable):
                        await store.finish(rid, "me", DELIVERED, NOW)
                finally:
                    server.resume()

                async def ran() -> bool:
                    try:
                        got = await store.get(rid)
                    except errors.DlqUnavailable:
                        return False
                    return got is not None and got["status"] == "delivered"

                await until_async(ran, "Redis to run the finish it had been sent")
                replayer = Replayer(store, None, None, owner="me")  # type: ignore[arg-type]
                caplog.clear()
                with caplog.at_level(logging.ERROR, "sidecar.dlq"):
                    await replayer._record(
                        rid, DELIVERED, ReplayOutcome(rid, "delivered", 200, "x", 1)
                    )
                assert [r.getMessage() for r in caplog.records] == []
                got = await store.get(rid)
                assert got is not None and got["replays"] == 1 and got["claimed_by"] is None
                assert not await store.finish(rid, "me", PARKED, NOW)  # not what it finished as
                assert not await store.finish(rid, "other", DELIVERED, NOW)

                # Lost for real: the lease ran out and another owner took the record over.
                lost = await store.add(rec())
                await store.claim(lost, "me", ("pending",), 0.2, NOW)

                async def taken() -> bool:
                    try:
                        await store.claim(lost, "other", ("pending",), 60.0, NOW)
                    except errors.RecordBusy:
                        return False
                    return True

                await until_async(taken, "the lease to run out")
                with caplog.at_level(logging.ERROR, "sidecar.dlq"):
                    await replayer._record(
                        lost, DELIVERED, ReplayOutcome(lost, "delivered", 200, "x", 1)
                    )
                assert any("the claim was lost" in r.getMessage() for r in caplog.records)
                assert await store.finish(lost, "other", DELIVERED, NOW)
                # ... and when that owner finished it, a late finish of the first is no retry
                assert not await store.finish(lost, "me", DELIVERED, NOW)
            finally:
                await store.close()

        run(main)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


async def _redis(server: RedisServer, name: str, *args: Any) -> Any:
    from redis.asyncio import Redis

    r = Redis.from_url(server.url)
    try:
        return await r.execute_command(name, *args)
    finally:
        await r.aclose()


def test_a_redis_that_lost_its_data_is_noticed_on_a_counts_read_and_on_a_write(
    run: Run, tmp_path: Path
) -> None:
    """Records acknowledged, then the Redis emptied (FLUSHALL): each store that knew the
    DLQ's epoch finds it gone, once (on its counts read, or on its next write), says so (the
    note, the callback the app counts) and sets the epoch again; nothing is reported on a
    Redis that kept its data."""
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            a, b = redis_store(server.url), redis_store(server.url)
            told: list[str] = []
            a.epoch.on_lost = lambda: told.append("a")
            b.epoch.on_lost = lambda: told.append("b")
            try:
                await a.add(rec())
                await b.refresh()
                await a.refresh()
                assert told == [] and a.epoch.note is None
                await _redis(server, "FLUSHALL")
                await a.refresh()  # the counts read finds it
                assert told == ["a"] and a.epoch.note is not None
                assert "may have been lost" in a.epoch.note
                assert await _redis(server, "GET", a.prefix + "meta:epoch") is not None
                await a.refresh()
                await b.add(rec())  # a write finds it too, and is stored
                assert told == ["a", "b"]
                await a.refresh()
                await b.refresh()
                assert told == ["a", "b"] and (a.epoch.losses, b.epoch.losses) == (1, 1)
                got, _ = await a.list()
                assert len(got) == 1
            finally:
                await a.close()
                await b.close()

        run(main)


def test_consumers_leave_at_close_and_idle_ones_are_swept_unless_they_hold_entries(
    run: Run, tmp_path: Path
) -> None:
    """A store's consumer leaves the group at close when it holds no pending entry, and stays
    while it holds one (DELCONSUMER would strand it); a redrive round removes the other
    consumers that hold nothing and sat idle past the bound, never one that holds entries."""
    with running(tmp_path / "redis") as server:

        async def consumers() -> dict[str, int]:
            rows = await _redis(server, "XINFO", "CONSUMERS", "retry-sidecar:dlq:main", "redrive")
            rows = [{_text(k): v for k, v in r.items()} for r in rows]  # parsed by redis-py
            return {_text(r["name"]): int(r["pending"]) for r in rows}

        def store(name: str) -> RedisDlqStore:
            link = FleetLink(FleetRedis(url=server.url, timeout=5.0), Clock())
            return RedisDlqStore(link, 1000, 10**7, location=server.url, consumer=name)

        async def main() -> None:
            idle = store("idle")
            assert await idle.due("main", 10, 60.0) == []
            await idle.close()
            assert await consumers() == {}  # it held nothing: it left
            holder, dead, sweeper = store("holder"), store("dead"), store("sweeper")
            try:
                rid = await holder.add(rec())
                assert await holder.due("main", 10, 60.0) == [rid]  # now pending on holder
                assert await dead.due("main", 10, 60.0) == []
                await holder.close()  # holds an entry: stays
                assert await consumers() == {"holder": 1, "dead": 0}
                sweeper.group.idle_max = 0.0

                async def swept() -> bool:
                    await sweeper.due("main", 10, 60.0)
                    return "dead" not in await consumers()

                await until_async(swept, "the idle consumer swept out")
                assert await consumers() == {"holder": 1, "sweeper": 0}
            finally:
                await dead.close()
                await sweeper.close()
            assert await consumers() == {"holder": 1}

        run(main)


def test_a_close_cancelled_while_leaving_the_groups_still_closes_the_client(
    run: Run, tmp_path: Path
) -> None:
    """The stop is cancelled while the consumer's leave is in flight (Redis paused): the
    store is closed and its connections with it."""
    with running(tmp_path / "redis") as server:

        async def named() -> list[str]:
            return client_list(server.port)

        async def main() -> None:
            store = redis_store(server.url)
            await store.due("main", 10, 60.0)  # joined the group
            assert any("retry-sidecar" in n for n in await named())
            server.pause()
            try:
                closing = asyncio.ensure_future(store.close())
                await _sent(store)
                closing.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await closing
            finally:
                server.resume()
            assert not store.available
            with pytest.raises(errors.DlqUnavailable):
                await store.add(rec())

            async def gone() -> bool:
                return not any("retry-sidecar" in n for n in await named())

            await until_async(gone, "the store's connections closed")

        run(main)


def test_the_prune_judges_the_audit_window_on_redis_s_clock(run: Run, tmp_path: Path) -> None:
    """A pod whose clock runs a day ahead prunes nothing delivered just now: the window is
    measured on Redis's clock, as the delivery was stamped."""
    from sidecar.dlq.replay import DELIVERED_RETENTION

    with running(tmp_path / "redis") as server:

        async def main() -> None:
            store = redis_store(server.url)
            try:
                ahead = lambda: time.time() + 86_400.0  # noqa: E731
                store.wall = ahead
                rid = await store.add(rec())
                await store.claim(rid, "me", ("pending",), 60.0, NOW)
                assert await store.finish(rid, "me", DELIVERED, NOW)
                assert await store.prune_delivered(ahead() - DELIVERED_RETENTION) == 0
                assert await store.get(rid) is not None
                assert await store.prune_delivered(ahead() + 1.0) == 1  # past it: pruned
            finally:
                await store.close()

        run(main)


def test_the_durability_check_reads_appendonly_and_appendfsync(run: Run, tmp_path: Path) -> None:
    assert aof.judge({"appendonly": "yes", "appendfsync": "always"}) is None
    everysec = aof.judge({"appendonly": "yes", "appendfsync": "everysec"})
    assert everysec is not None and "appendfsync everysec" in everysec
    assert aof.cannot_check("unknown command 'CONFIG'").startswith("cannot check")
    with running(tmp_path / "redis") as server:

        async def main() -> None:
            link = FleetLink(FleetRedis(url=server.url, timeout=5.0), FakeClock())
            try:
                assert await aof.check(link) is None
                await link.client.config_set("appendfsync", "everysec")
                warning = await aof.check(link)
                assert warning is not None and "appendfsync everysec" in warning
                await link.client.config_set("appendfsync", "always")
            finally:
                await link.close()

        run(main)

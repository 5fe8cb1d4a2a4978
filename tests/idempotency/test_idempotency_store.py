"""The SQLite idempotency store, for real: temporary files, restarts by reopening, concurrent
claims from coroutines, threads and processes, a writer killed mid-transaction. Each async test
runs under asyncio and under uvloop (as shipped). The contract tests that take ``with_store``
run for the fleet's Redis store too, against a real redis-server (tests/redisserver.py)."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import stat
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
import uvloop

from sidecar.config.fleet import FleetRedis
from sidecar.fleet.connection import FleetLink
from sidecar.idempotency import schema
from sidecar.idempotency.fingerprint import NO_SCOPE, legacy_key, scope_digest, stored_key
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.prune import prune_pass
from sidecar.idempotency.redisstore import RedisIdempotencyStore
from sidecar.idempotency.sqlite import Bounds, SqliteIdempotencyStore
from sidecar.idempotency.store import (
    Busy,
    Claimed,
    Finished,
    IdempotencyStore,
    Kept,
    Mismatch,
    StoreError,
)
from sidecar.testing import FakeClock
from tests.proc import run_until_line_then_kill
from tests.redisserver import running

Run = Callable[[Callable[[], Awaitable[Any]]], Any]
WithStore = Callable[[Callable[[IdempotencyStore], Awaitable[Any]]], Any]
ANSWER = KeptAnswer(201, ((b"Content-Type", b"application/json"),), b'{"id": 7}')


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    def go(main: Callable[[], Awaitable[Any]]) -> Any:
        async def wrapped() -> Any:
            return await main()

        if request.param == "uvloop":
            return uvloop.run(wrapped())
        return asyncio.run(wrapped())

    return go


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "keys" / "idempotency.sqlite3"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(db: Path, clock: FakeClock) -> Iterator[SqliteIdempotencyStore]:
    s = opened(db, clock)
    yield s
    s.close()


def opened(path: Path, clock: FakeClock, **kw: Any) -> SqliteIdempotencyStore:
    store = SqliteIdempotencyStore(str(path), clock, **kw)
    store.open()
    return store


def redis_store(url: str, clock: FakeClock, timeout: float = 5.0) -> RedisIdempotencyStore:
    """The fleet store on a real Redis; made inside the loop that uses it (its connections
    belong to that loop)."""
    settings = FleetRedis(url=url, key_prefix="test:", password_env=None, timeout=timeout)
    return RedisIdempotencyStore(FleetLink(settings, clock), clock)


@pytest.fixture(params=["sqlite", "redis"])
def with_store(
    request: pytest.FixtureRequest, run: Run, db: Path, clock: FakeClock, tmp_path: Path
) -> Iterator[WithStore]:
    """Runs ``main(store)`` in a fresh loop, on each backend of the contract."""
    with ExitStack() as stack:
        if request.param == "sqlite":
            s = opened(db, clock)
            stack.callback(s.close)
            yield lambda main: run(lambda: main(s))
            return
        server = stack.enter_context(running(tmp_path / "redis"))

        def go(main: Callable[[IdempotencyStore], Awaitable[Any]]) -> Any:
            async def inner() -> Any:
                store = redis_store(server.url, clock)
                try:
                    return await main(store)
                finally:
                    await store.close()

            return run(inner)

        yield go


def test_a_finished_answer_is_replayed_and_survives_a_restart(
    run: Run, db: Path, clock: FakeClock
) -> None:
    first = opened(db, clock)

    async def before() -> None:
        claim = await first.claim("k", "fp", 30.0)
        assert isinstance(claim, Claimed) and not claim.took_over
        busy = await first.claim("k", "fp", 30.0)
        assert busy == Busy(clock.wall() + 30.0)
        assert await first.claim("k", "other", 30.0) == Mismatch()
        assert await first.complete("k", claim.token, ANSWER, 3600.0)

    run(before)
    first.close()
    assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    with sqlite3.connect(db) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    again = opened(db, clock)

    async def after() -> None:
        got = await again.claim("k", "fp", 30.0)
        assert isinstance(got, Finished) and got.record.answer == ANSWER
        assert got.record.finished and got.record.expires_at == clock.wall() + 3600.0
        assert await again.claim("k", "other", 30.0) == Mismatch()
        record = await again.get("k")
        assert record is not None and record.answer == ANSWER
        assert await again.forget("k")
        assert isinstance(await again.claim("k", "fp", 30.0), Claimed)

    run(after)
    again.close()


def test_holders_finds_a_key_in_every_scope_by_the_key_alone(with_store: WithStore) -> None:
    """A scoped key is found by the client's key alone, in every scope and state; a key holding
    a glob's or LIKE's special characters matches only itself."""
    alice, bob = scope_digest(((b"x-user", b"alice"),), "X-User"), scope_digest((), "X-User")
    odd = "a*[b]?\\%_c"

    async def main(store: IdempotencyStore) -> None:
        for name in (
            stored_key("k", alice, "orders"),
            stored_key("k", NO_SCOPE, "orders"),
            stored_key(odd, bob, "orders"),
        ):
            claim = await store.claim(name, "fp", 30.0)
            assert isinstance(claim, Claimed)
            if name != stored_key(odd, bob, "orders"):  # one left in progress
                assert await store.complete(name, claim.token, ANSWER, 3600.0)
        await store.claim(stored_key("kk", alice, "orders"), "fp", 30.0)
        await store.claim(stored_key("a1[b]x%_c", alice, "orders"), "fp", 30.0)
        assert await store.holders("k") == sorted([stored_key("k", alice, "orders"), "orders/- k"])
        assert await store.holders(odd) == [stored_key(odd, bob, "orders")]
        assert await store.holders("nope") == []
        assert await store.forget(stored_key("k", alice, "orders"))
        assert await store.holders("k") == ["orders/- k"]

    with_store(main)


def test_a_store_written_before_the_key_index_is_read_and_found(
    run: Run, db: Path, clock: FakeClock
) -> None:
    """A file of the first schema (no index on the bare key) opens, keeps its keys, and finds
    them by the key alone; the lookup uses the index, not a scan."""
    db.parent.mkdir(parents=True)
    conn = sqlite3.connect(db, isolation_level=None)
    conn.execute(
        "CREATE TABLE idempotency_keys (key TEXT PRIMARY KEY, finished INTEGER NOT NULL, "
        "fingerprint TEXT NOT NULL, token TEXT, created_at REAL NOT NULL, "
        "expires_at REAL NOT NULL, status INTEGER, headers TEXT, body BLOB, size INTEGER)"
    )
    name = legacy_key("old", "ab" * 32)
    conn.execute(
        "INSERT INTO idempotency_keys VALUES (?, 1, 'fp', NULL, ?, ?, 201, '[]', x'7b7d', NULL)",
        (name, clock.wall(), clock.wall() + 3600),
    )
    conn.execute("PRAGMA user_version = 1")
    conn.close()
    store = opened(db, clock)
    try:
        assert run(lambda: store.holders("old")) == [name]
        record = run(lambda: store.get(name))
        assert record is not None and record.answer == KeptAnswer(201, (), b"{}")
        plan = sqlite3.connect(db).execute(
            f"EXPLAIN QUERY PLAN SELECT key FROM idempotency_keys WHERE {schema.BARE_KEY} = 'x'"
        )
        assert "idempotency_keys_bare" in " ".join(str(row) for row in plan)
    finally:
        store.close()


def test_release_and_complete_are_compare_and_set_on_the_token(with_store: WithStore) -> None:
    async def main(store: IdempotencyStore) -> None:
        claim = await store.claim("k", "fp", 30.0)
        assert isinstance(claim, Claimed)
        assert not await store.release("k", "not-the-token")
        assert not await store.complete("k", "not-the-token", ANSWER, 60.0)
        assert isinstance(await store.claim("k", "fp", 30.0), Busy)
        assert await store.release("k", claim.token)
        assert not await store.release("k", claim.token)
        assert await store.get("k") is None
        assert isinstance(await store.claim("k", "fp", 30.0), Claimed)

    with_store(main)


def test_renew_moves_the_lease_of_its_holder_only(run: Run, db: Path, clock: FakeClock) -> None:
    """The holder's heartbeat: a compare-and-set on the token, in progress only (both
    backends)."""

    async def main(store: IdempotencyStore) -> None:
        claim = await store.claim("k", "fp", 5.0)
        assert isinstance(claim, Claimed)
        clock.advance(4.0)
        assert await store.renew("k", claim.token, 5.0)
        record = await store.get("k")
        assert record is not None and record.expires_at == clock.wall() + 5.0
        clock.advance(4.0)  # past the first lease, within the renewed one
        busy = await store.claim("k", "fp", 5.0)
        assert isinstance(busy, Busy) and busy.expiry == clock.wall() + 1.0
        assert not await store.renew("k", "not-the-token", 60.0)
        assert not await store.renew("absent", claim.token, 60.0)
        assert await store.complete("k", claim.token, ANSWER, 60.0)
        assert not await store.renew("k", claim.token, 5.0)  # finished: not a lease any more
        record = await store.get("k")
        assert record is not None and record.finished and record.expires_at == clock.wall() + 60

    store = opened(db, clock)  # on a clock the test moves (Redis's: test_idempotency_redis.py)
    try:
        run(lambda: main(store))
    finally:
        store.close()


def test_a_dead_holders_lease_is_taken_over_and_its_late_answer_refused(
    run: Run, db: Path, clock: FakeClock
) -> None:
    async def main(store: IdempotencyStore) -> None:
        dead = await store.claim("k", "fp", 5.0)
        assert isinstance(dead, Claimed)
        clock.advance(4.9)
        assert isinstance(await store.claim("k", "fp", 5.0), Busy)
        clock.advance(0.1)
        taker = await store.claim("k", "fp", 5.0)
        assert isinstance(taker, Claimed) and taker.took_over
        assert not await store.complete("k", dead.token, ANSWER, 60.0)
        assert not await store.release("k", dead.token)
        assert await store.complete("k", taker.token, ANSWER, 60.0)
        clock.advance(60.0)  # the ttl passed: the key is gone, a new request is first
        again = await store.claim("k", "other", 5.0)
        assert isinstance(again, Claimed) and not again.took_over

    store = opened(db, clock)  # on a clock the test moves (Redis's: test_idempotency_redis.py)
    try:
        run(lambda: main(store))
    finally:
        store.close()


def test_concurrent_claims_from_coroutines_give_exactly_one_claim(with_store: WithStore) -> None:
    async def main(store: IdempotencyStore) -> list[object]:
        return list(await asyncio.gather(*(store.claim("k", "fp", 30.0) for _ in range(100))))

    results = with_store(main)
    assert sum(isinstance(r, Claimed) for r in results) == 1
    assert sum(isinstance(r, Busy) for r in results) == 99


def test_concurrent_claims_from_threads_each_with_its_store_give_exactly_one(
    db: Path, clock: FakeClock
) -> None:
    """Four stores on one file (as four processes sharing it), each driven by its own thread
    and loop: the claim's transaction makes one of the 100 claims win. (A shared file waits
    longer for its lock than the default 50 ms: one sidecar owns its file.)"""
    stores = [opened(db, clock, busy_timeout_ms=30_000) for _ in range(4)]
    results: list[object] = []
    lock = threading.Lock()
    start = threading.Barrier(len(stores))

    def worker(s: SqliteIdempotencyStore) -> None:
        async def main() -> list[object]:
            start.wait()
            return list(await asyncio.gather(*(s.claim("k", "fp", 30.0) for _ in range(25))))

        got = asyncio.run(main())
        with lock:
            results.extend(got)

    threads = [threading.Thread(target=worker, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for s in stores:
        s.close()
    assert len(results) == 100
    assert sum(isinstance(r, Claimed) for r in results) == 1


def hold_the_write_lock(db: Path) -> sqlite3.Connection:
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")
    return blocker


async def loop_lag_while(call: Awaitable[Any]) -> tuple[BaseException | Any, float]:
    """What ``call`` gave (or raised), and the longest the loop went without running a probe
    that ticks every millisecond meanwhile."""
    loop = asyncio.get_running_loop()
    last, worst = loop.time(), 0.0
    stop = asyncio.Event()

    async def probe() -> None:
        nonlocal last, worst
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = loop.time()
            worst, last = max(worst, now - last), now

    prober = asyncio.ensure_future(probe())
    await asyncio.sleep(0.01)
    try:
        got: BaseException | Any = await call
    except BaseException as exc:
        got = exc
    await asyncio.sleep(0.01)
    stop.set()
    await prober
    return got, worst


def test_a_locked_file_is_a_store_error_soon_and_leaves_no_key(
    run: Run, db: Path, clock: FakeClock
) -> None:
    """A lock held elsewhere (another process on the file): the call waits at most the
    store's busy timeout (50 ms) on the loop thread, then is a StoreError (the route's
    ``on_store_error`` applies); the loop is not held beyond it. Generous bound: 1 s."""
    store = opened(db, clock)
    blocker = hold_the_write_lock(db)

    async def main() -> None:
        got, lag = await loop_lag_while(store.claim("k", "fp", 30.0))
        assert isinstance(got, StoreError), got
        assert lag < 1.0, lag
        blocker.execute("COMMIT")
        assert await store.get("k") is None
        assert isinstance(await store.claim("k", "fp", 30.0), Claimed)

    try:
        run(main)
    finally:
        blocker.close()
        store.close()


def test_a_call_answers_on_the_loop_thread_without_yielding(
    store: SqliteIdempotencyStore,
) -> None:
    """No thread hop, no loop iteration: each call's coroutine ends at its first step (a
    store that queued to a thread would yield a future here)."""

    def at_once(call: Coroutine[Any, Any, Any]) -> Any:
        with pytest.raises(StopIteration) as ended:
            call.send(None)
        return ended.value.value

    claim = at_once(store.claim("k", "fp", 30.0))
    assert isinstance(claim, Claimed)
    assert isinstance(at_once(store.claim("k", "fp", 30.0)), Busy)
    assert at_once(store.complete("k", claim.token, ANSWER, 60.0)) is Kept.WHOLE
    record = at_once(store.get("k"))
    assert record is not None and record.answer == ANSWER
    assert at_once(store.prune(10)) == 0
    assert at_once(store.forget("k")) is True


def test_a_claim_cancelled_around_it_leaves_no_half_key(
    run: Run, store: SqliteIdempotencyStore
) -> None:
    """A call runs to its end without yielding, so it cannot be cancelled half-way: cancelled
    before its turn it wrote nothing; cancelled after, its key is whole."""

    async def main() -> None:
        before = asyncio.ensure_future(store.claim("k", "fp", 30.0))
        before.cancel()
        with pytest.raises(asyncio.CancelledError):
            await before
        assert await store.get("k") is None
        after = asyncio.ensure_future(store.claim("k", "fp", 30.0))
        await asyncio.sleep(0)
        after.cancel()  # too late: it ran
        claim = await after
        assert isinstance(claim, Claimed)
        record = await store.get("k")
        assert record is not None and not record.finished and record.fingerprint == "fp"
        assert await store.release("k", claim.token)

    run(main)


def test_a_closed_store_is_a_store_error(run: Run, db: Path, clock: FakeClock) -> None:
    store = opened(db, clock)
    store.close()

    async def main() -> None:
        with pytest.raises(StoreError):
            await store.claim("k", "fp", 30.0)

    run(main)


def test_expired_keys_are_pruned_in_bounded_batches(run: Run, db: Path, clock: FakeClock) -> None:
    store = opened(db, clock, abandoned_keep=100.0)
    calls: list[int] = []
    real_prune = store.prune

    async def counted(limit: int) -> int:
        n = await real_prune(limit)
        calls.append(n)
        return n

    store.prune = counted  # type: ignore[method-assign]

    async def main() -> None:
        for i in range(7):
            claim = await store.claim(f"done{i}", "fp", 5.0)
            assert isinstance(claim, Claimed)
            assert await store.complete(f"done{i}", claim.token, ANSWER, 10.0)
        for i in range(2):
            await store.claim(f"held{i}", "fp", 5.0)
        await store.claim("live", "fp", 1000.0)
        assert await prune_pass(store, batch=3) == 0
        clock.advance(11.0)  # the answers' ttl passed; the abandoned claims are kept longer
        assert await prune_pass(store, batch=3) == 7
        assert calls[-3:] == [3, 3, 1]
        assert await store.get("held0") is not None
        clock.advance(100.0)
        assert await prune_pass(store, batch=3) == 2
        assert await store.get("held1") is None and await store.get("live") is not None

    try:
        run(main)
    finally:
        store.close()


KILLED = """
import sqlite3, sys
from sidecar.idempotency import schema
from sidecar.idempotency import schema
from sidecar.idempotency.fingerprint import NO_SCOPE, scope_digest, stored_key
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.sqlite import claim_tx, complete_tx, connect

conn = connect(sys.argv[1], 5000)
schema.migrate(conn)
conn.execute("BEGIN IMMEDIATE")
claimed = claim_tx(conn, "k", "fp", 30.0, "token", 1000.0)
complete_tx(conn, "k", "token", KeptAnswer(201, (), b"x" * 100_000), 60.0, 1000.0)
if sys.argv[2] == "commit":
    conn.execute("COMMIT")
print("written", flush=True)
sys.stdin.readline()  # killed here
"""


@pytest.mark.parametrize("commit", [False, True])
def test_a_writer_killed_mid_transaction_leaves_no_key_or_a_whole_one(
    run: Run, db: Path, clock: FakeClock, commit: bool
) -> None:
    db.parent.mkdir(parents=True, exist_ok=True)
    run_until_line_then_kill(KILLED, str(db), "commit" if commit else "hold", line=b"written\n")
    store = opened(db, clock)

    async def main() -> None:
        record = await store.get("k")
        if commit:
            assert record is not None and record.finished
            assert record.answer == KeptAnswer(201, (), b"x" * 100_000)
        else:
            assert record is None
            assert isinstance(await store.claim("k", "fp", 30.0), Claimed)

    try:
        run(main)
    finally:
        store.close()


def real_tally(path: Path) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the tally the triggers keep, the count and size of the rows as they are), read from the
    file by another connection."""
    conn = sqlite3.connect(path)
    try:
        kept = conn.execute("SELECT records, bytes FROM idempotency_tally WHERE id = 0").fetchone()
        size = schema._size("k")
        rows = conn.execute(
            f"SELECT COUNT(*), COALESCE(SUM({size}), 0) FROM idempotency_keys AS k"
        ).fetchone()
        return (int(kept[0]), int(kept[1])), (int(rows[0]), int(rows[1]))
    finally:
        conn.close()


def test_the_tally_stays_exact_after_keep_release_prune_and_forget(
    run: Run, db: Path, clock: FakeClock
) -> None:
    """Issue 29 item 7: ``max_records``/``max_bytes`` read the tally the triggers keep; after
    every kind of write (a claim, a kept answer, a release, a take-over of a lease run out, a
    replaced expired key, a prune, a forget) it equals COUNT(*) and the rows' size."""
    store = opened(db, clock, abandoned_keep=50.0)
    steps: list[str] = []

    def exact(step: str) -> None:
        kept, rows = real_tally(db)
        assert kept == rows, (step, kept, rows)
        steps.append(step)

    async def main() -> None:
        exact("empty")
        tokens = {}
        for i in range(6):
            claim = await store.claim(f"k{i}", "fp" * i, 5.0)
            assert isinstance(claim, Claimed)
            tokens[i] = claim.token
        exact("claims")
        big = KeptAnswer(201, ((b"X-Big", b"v" * 300),), b"b" * 70_000)
        for i in (0, 1, 2):
            assert await store.complete(f"k{i}", tokens[i], big if i else ANSWER, 10.0)
        exact("keep")
        assert await store.release("k3", tokens[3])
        exact("release")
        clock.advance(6.0)  # k4, k5's leases ran out: taken over by a new claim
        assert isinstance(await store.claim("k4", "fp" * 4, 5.0), Claimed)
        exact("take-over")
        clock.advance(11.0)  # k0-k2's answers are past their ttl: k1 claimed anew
        assert isinstance(await store.claim("k1", "fp", 5.0), Claimed)
        exact("expired key claimed anew")
        assert await prune_pass(store, batch=2) > 0
        exact("prune")
        assert await store.forget("k1")
        assert not await store.forget("k1")
        exact("forget")
        clock.advance(1000.0)
        await prune_pass(store, batch=10)
        exact("prune all")
        assert real_tally(db)[0] == (0, 0)

    try:
        run(main)
    finally:
        store.close()
    # Reopened, the tally is the file's (the schema's INSERT OR IGNORE keeps what is there).
    again = opened(db, clock)
    again.close()
    exact("reopened")


def test_keys_live_per_route_and_a_legacy_name_is_honoured(with_store: WithStore) -> None:
    """The same key on two routes is two keys; a key the previous version stored under its
    legacy name (``<scope> <key>``, no route: written here as that version wrote it) is judged
    as the key's own while the new name is absent, never written: finished with the same
    request, replayed; another request, 422; in progress, 409; gone, the new name is claimed."""
    blue, green = stored_key("k", NO_SCOPE, "blue"), stored_key("k", NO_SCOPE, "green")
    old = legacy_key("k", NO_SCOPE)

    async def main(store: IdempotencyStore) -> None:
        first = await store.claim(blue, "fp", 30.0)  # no legacy name yet
        assert isinstance(first, Claimed)
        assert await store.complete(blue, first.token, ANSWER, 3600.0)
        assert isinstance(await store.claim(green, "fp", 30.0), Claimed)  # another route's
        # The previous version's keys, in its naming: one finished, one in progress.
        done = await store.claim(old, "fp", 30.0)
        assert isinstance(done, Claimed)
        assert await store.complete(old, done.token, ANSWER, 3600.0)
        held = legacy_key("h", NO_SCOPE)
        assert isinstance(await store.claim(held, "fp", 30.0), Claimed)
        fresh = stored_key("k", NO_SCOPE, "red")
        replayed = await store.claim(fresh, "fp", 30.0, old)
        assert isinstance(replayed, Finished) and replayed.record.answer == ANSWER
        assert await store.claim(fresh, "other", 30.0, old) == Mismatch()
        assert await store.get(fresh) is None  # read only: the new name was not written
        busy = await store.claim(stored_key("h", NO_SCOPE, "red"), "fp", 30.0, held)
        assert isinstance(busy, Busy)
        assert await store.claim(stored_key("h", NO_SCOPE, "red"), "x", 30.0, held) == Mismatch()
        # The new name, once present, is judged alone (blue's own key, finished).
        again = await store.claim(blue, "fp", 30.0, old)
        assert isinstance(again, Finished)
        assert await store.claim(blue, "other", 30.0, old) == Mismatch()
        assert await store.forget(old)  # the legacy key gone (expired): the new name claimed
        assert isinstance(await store.claim(fresh, "other", 30.0, old), Claimed)
        assert await store.holders("k") == sorted([blue, green, fresh])

    with_store(main)


def test_a_legacy_key_past_its_ttl_or_lease_is_as_absent(
    run: Run, db: Path, clock: FakeClock
) -> None:
    """SQLite, whose clock the test moves: a legacy key past its ttl, or an abandoned legacy
    claim past its lease, no longer answers for the key: the new name is claimed."""
    store = opened(db, clock)
    try:

        async def main() -> None:
            done = await store.claim(legacy_key("f", NO_SCOPE), "fp", 30.0)
            assert isinstance(done, Claimed)
            assert await store.complete(legacy_key("f", NO_SCOPE), done.token, ANSWER, 60.0)
            assert isinstance(await store.claim(legacy_key("h", NO_SCOPE), "fp", 30.0), Claimed)
            clock.advance(61.0)
            for k in ("f", "h"):
                got = await store.claim(
                    stored_key(k, NO_SCOPE, "r"), "fp", 30.0, legacy_key(k, NO_SCOPE)
                )
                assert isinstance(got, Claimed), k

        run(main)
    finally:
        store.close()


def test_max_bytes_bounds_the_kept_answers_not_only_the_claims(
    run: Run, db: Path, clock: FakeClock
) -> None:
    """Issue 29 F1: ``max_bytes`` was read at claim time only, before the answer's size was
    known: ten keys claimed in an empty file, then ten 20 KB answers kept, and the file held
    200 KB under a 64 KiB bound. An answer that would put the file past the bound is kept
    without its body (``Kept.WITHOUT_BODY``: the key finished, status and size only), so the
    tally passes the bound by at most one key's head; the tally stays exact."""
    bound = 64 * 1024
    store = opened(db, clock, bounds=Bounds(max_records=1000, max_bytes=bound))
    body = b"x" * 20_000

    async def main() -> None:
        tokens = []
        for i in range(10):
            claim = await store.claim(f"k{i}", "f" * 64, 30.0)
            assert isinstance(claim, Claimed)
            tokens.append(claim.token)
        answer = KeptAnswer(201, ((b"Content-Type", b"text/plain"),), body)
        kept = [await store.complete(f"k{i}", tokens[i], answer, 60.0) for i in range(10)]
        assert kept[:3] == [Kept.WHOLE] * 3 and kept[3:] == [Kept.WITHOUT_BODY] * 7, kept
        (records, size), rows = real_tally(db)
        assert (records, size) == rows and records == 10
        assert size <= bound, size
        for i in range(10):
            record = await store.get(f"k{i}")
            assert record is not None and record.finished and record.answer is not None
            if i < 3:
                assert record.answer == answer
            else:  # what a duplicate is replayed: the status, "answer not kept"
                assert record.answer == KeptAnswer(201, (), None, len(body))
        # Not ours any more: NOT_OURS (false), the key untouched.
        assert await store.complete("k0", tokens[0], answer, 60.0) is Kept.NOT_OURS

    try:
        run(main)
    finally:
        store.close()

"""What survives what, for the SQLite store that commits on the loop with ``synchronous=NORMAL``:
a process crash loses nothing committed (SIGKILL of a real process running the store under
uvloop), the loop's commits never checkpoint (no fsync on the request path), the background
``idempotency-sync`` checkpoint puts committed keys into the file itself without taking the
write lock, runs only after writes, and is a named task of the sidecar, cancelled at stop."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sqlite3
from pathlib import Path

import pytest
import uvloop

from sidecar.idempotency.durability import sync_forever
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.sqlite import SqliteIdempotencyStore
from sidecar.idempotency.store import Claimed, StoreError
from sidecar.testing import FakeClock
from tests.conftest import routes_yaml
from tests.proc import run_until_line_then_kill
from tests.wait import until

ANSWER = KeptAnswer(201, ((b"Content-Type", b"application/json"),), b'{"id": 7}')


@pytest.fixture
def db(tmp_path: Path) -> Path:
    return tmp_path / "keys" / "idempotency.sqlite3"


def opened(db: Path) -> SqliteIdempotencyStore:
    store = SqliteIdempotencyStore(str(db), FakeClock())
    store.open()
    return store


def write(store: SqliteIdempotencyStore, key: str, body: bytes = b'{"id": 7}') -> None:
    async def main() -> None:
        claim = await store.claim(key, "fp", 30.0)
        assert isinstance(claim, Claimed)
        assert await store.complete(key, claim.token, KeptAnswer(201, (), body), 3600.0)

    uvloop.run(main())


def in_the_file_itself(db: Path, tmp_path: Path) -> set[str]:
    """The keys of the main file alone, as a copy without its WAL: what a checkpoint copied."""
    lone = tmp_path / "lone.sqlite3"
    shutil.copyfile(db, lone)
    with sqlite3.connect(lone) as conn:
        try:
            return {k for (k,) in conn.execute("SELECT key FROM idempotency_keys")}
        except sqlite3.OperationalError:  # not even the table: nothing checkpointed yet
            return set()


def test_the_loops_commits_never_checkpoint_the_background_one_does(
    db: Path, tmp_path: Path
) -> None:
    """Past SQLite's automatic checkpoint threshold (1000 pages), the loop's commits still
    leave the file itself alone; ``checkpoint`` (the background task's step) copies them."""
    store = opened(db)
    try:
        store.checkpoint()  # the table itself, in the file
        for i in range(300):
            write(store, f"k{i}", b"x" * 16_000)  # ~4 pages each: 1200 pages of WAL
        assert in_the_file_itself(db, tmp_path) == set()
        assert store.take_written() and not store.take_written()
        store.checkpoint()
        assert in_the_file_itself(db, tmp_path) == {f"k{i}" for i in range(300)}
    finally:
        store.close()


def test_a_checkpoint_takes_no_write_lock(db: Path, tmp_path: Path) -> None:
    """Another connection holding the write lock (as the loop's, mid-transaction) does not
    stop the checkpoint: the committed keys reach the file, the open transaction goes on."""
    store = opened(db)
    blocker = sqlite3.connect(db, isolation_level=None)
    try:
        write(store, "committed")
        blocker.execute("BEGIN IMMEDIATE")
        blocker.execute(
            "INSERT INTO idempotency_keys (key, finished, fingerprint, created_at, expires_at) "
            "VALUES ('open', 0, 'fp', 0, 0)"
        )
        store.checkpoint()
        assert in_the_file_itself(db, tmp_path) == {"committed"}
        blocker.execute("COMMIT")
    finally:
        blocker.close()
        store.close()


def test_close_checkpoints_in_full(db: Path, tmp_path: Path) -> None:
    store = opened(db)
    write(store, "k")
    store.close()
    assert in_the_file_itself(db, tmp_path) == {"k"}


class Counted:
    """A store's checkpoint side, counted; the sync task's sleep driven by the test."""

    def __init__(self, fail_first: bool = False) -> None:
        self.written = False
        self.checkpoints = 0
        self.fail_next = fail_first

    def take_written(self) -> bool:
        written, self.written = self.written, False
        return written

    def checkpoint(self) -> bool:
        self.checkpoints += 1
        if self.fail_next:
            self.fail_next = False
            self.written = True  # as the store: still to be made durable
            raise StoreError("disk gone")
        return False

    async def reset_log(self) -> None:
        raise AssertionError("the log is never past its bound here")


@pytest.mark.parametrize("fail_first", [False, True])
def test_the_sync_task_checkpoints_after_writes_only(fail_first: bool) -> None:
    store = Counted(fail_first)

    async def main() -> None:
        ticks = asyncio.Queue[asyncio.Future[None]]()

        async def sleep(_: float) -> None:
            tick = asyncio.get_running_loop().create_future()
            await ticks.put(tick)
            await tick

        async def tick() -> None:
            (await ticks.get()).set_result(None)
            await until(lambda: not ticks.empty(), "the sync task's next sleep")

        task = asyncio.ensure_future(sync_forever(store, 0.1, sleep))
        await until(lambda: not ticks.empty(), "the sync task's first sleep")
        await tick()
        assert store.checkpoints == 0  # nothing written
        store.written = True
        await tick()
        assert store.checkpoints == 1
        await tick()
        assert store.checkpoints == (2 if fail_first else 1)  # a failed one is tried again
        await tick()
        assert store.checkpoints == (2 if fail_first else 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    uvloop.run(main())


BIG = KeptAnswer(201, ((b"Content-Type", b"application/json"),), b"x" * 16384)
RESET_AT = 1 << 20  # the store's bound on the log after a checkpoint, small for the test
WRITES = 1500  # guarded writes (claim and keep): ~25 MB of log without a reset
EVERY_WRITES = 20  # the sync task's tick: after this many writes (not a time)


def test_the_wal_stays_bounded_under_sustained_writes(db: Path) -> None:
    """Issue 29 item 8: writes that never stop, as at the proxy's peak guarded-write rate,
    land during every background checkpoint, so a passive checkpoint alone never lets SQLite
    start the log again: it grew without end. The sync task, ticking every ``EVERY_WRITES``
    writes (count-based) while up to ``EVERY_WRITES`` writes go on during its checkpoint, keeps the real file's WAL under a
    small multiple of its bound, and every write still succeeds (none waits longer than a
    reset, none fails)."""
    store = SqliteIdempotencyStore(str(db), FakeClock(), wal_reset_bytes=RESET_AT)
    store.open()
    largest = 0

    async def main() -> None:
        nonlocal largest
        due, idle = asyncio.Event(), asyncio.Event()

        async def sleep(_: float) -> None:
            idle.set()  # the last tick's checkpoint (and reset) done
            await due.wait()
            due.clear()

        task = asyncio.ensure_future(sync_forever(store, 0.1, sleep))
        try:
            for i in range(WRITES):
                claim = await store.claim(f"k{i}", "fp", 30.0)
                assert isinstance(claim, Claimed)
                assert await store.complete(f"k{i}", claim.token, BIG, 3600.0)
                largest = max(largest, store.wal_bytes())
                if i % EVERY_WRITES == 0:
                    # At most EVERY_WRITES writes run during one tick's checkpoint: a bound in
                    # writes, not in time, whatever the machine's speed.
                    await idle.wait()
                    idle.clear()
                    due.set()
                await asyncio.sleep(0)  # the checkpoint's thread runs while writes go on
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    try:
        uvloop.run(main())
    finally:
        store.close()
    assert largest < 4 * RESET_AT, f"the WAL reached {largest} bytes"
    assert store.wal_resets > 0


def test_a_reset_cancelled_half_way_lets_the_calls_go_on(db: Path) -> None:
    """``reset_log`` holds the store's calls: cancelled while its checkpoint runs, it lets
    them go at once, and the calls held meanwhile run."""
    store = opened(db)

    async def main() -> None:
        reset = asyncio.ensure_future(store.reset_log())
        await asyncio.sleep(0)  # the calls are held from here
        claim = asyncio.ensure_future(store.claim("k", "fp", 30.0))
        await asyncio.sleep(0)
        assert not claim.done()
        reset.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reset
        assert isinstance(await claim, Claimed)
        assert isinstance(await store.claim("k2", "fp", 30.0), Claimed)

    try:
        uvloop.run(main())
    finally:
        store.close()


KILLED = """
import asyncio, sys, uvloop
from sidecar.core import Clock
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.sqlite import SqliteIdempotencyStore

async def main() -> None:
    store = SqliteIdempotencyStore(sys.argv[1], Clock())
    await asyncio.to_thread(store.open)
    claim = await store.claim("k", "fp", 30.0)
    assert await store.complete("k", claim.token, KeptAnswer(201, (), b"kept"), 3600.0)
    print("acknowledged", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # killed here

uvloop.run(main())
"""


def test_an_acknowledged_answer_survives_a_sigkill_of_its_process(db: Path) -> None:
    """No clean close, no checkpoint: the committed WAL is in the OS page cache."""
    run_until_line_then_kill(KILLED, str(db), line=b"acknowledged\n")
    store = opened(db)

    async def main() -> None:
        record = await store.get("k")
        assert record is not None and record.finished
        assert record.answer == KeptAnswer(201, (), b"kept")

    try:
        uvloop.run(main())
    finally:
        store.close()


async def test_the_sidecar_runs_idempotency_sync_and_cancels_it_on_stop(
    upstream_factory, tmp_path: Path
) -> None:
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    up = await upstream_factory()
    text = routes_yaml(
        up.url,
        route_extra="    idempotency: {enabled: true}",
        top_extra=f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}',
    )
    sc = Sidecar(parse_text(text))
    await sc.start()
    try:
        assert {"idempotency-sync", "idempotency-prune"} <= set(sc.task_names())
        task = next(t for t in asyncio.all_tasks() if t.get_name() == "idempotency-sync")
    finally:
        await sc.stop()
    assert task.cancelled() and sc.task_names() == []

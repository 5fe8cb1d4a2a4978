"""Who may send a DLQ record, and when: claims in the file (across store instances and
processes), leases left by a crash, cancellation half-way, the redrive's safety rule, its
breaker probes and its survival of storage errors. Real SQLite, real sockets, real processes."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from sidecar.dlq import errors as dlq_errors
from sidecar.dlq import operations as dlq_operations
from sidecar.dlq.record import NewRecord
from sidecar.dlq.store import DlqStore
from tests.conftest import reply
from tests.dlq.test_dlq import admin, dlq_yaml
from tests.proc import SidecarProcess, free_port

NOW = 1_800_000_000.0


def rec(method: str = "PUT", key: str | None = "k", reached: bool = True) -> NewRecord:
    return NewRecord(
        "main", method, "/o", [], b"body", "exhausted", 1, 503, None, key, NOW, reached
    )


def row(db: Path, rid: str) -> dict[str, Any]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        r = conn.execute("SELECT * FROM records WHERE id = ?", (rid,)).fetchone()
        assert r is not None
        return dict(r)
    finally:
        conn.close()


async def eventually(check, timeout: float = 10.0, every: float = 0.05) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if check():
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(every)


# -- claims in the store ---------------------------------------------------------------------


async def test_claims_are_exclusive_across_store_instances(tmp_path):
    """Two store instances on one file (as two processes would have): every concurrent claim
    of a record is granted to exactly one of them; a delivered record is never granted."""
    db = str(tmp_path / "dlq.sqlite3")
    a, b = DlqStore(db, 1000, 10**7), DlqStore(db, 1000, 10**7)
    a.open()
    b.open()
    try:
        ids = [await a.add(rec()) for _ in range(40)]

        async def try_claim(store: DlqStore, owner: str, rid: str) -> str | None:
            try:
                await store.claim(rid, owner, ("pending", "parked"), 60.0, NOW)
            except dlq_errors.RecordBusy:
                return None
            return owner

        grants = await asyncio.gather(
            *(try_claim(s, o, rid) for rid in ids for s, o in ((a, "A"), (b, "B"), (a, "A2")))
        )
        per_record = [grants[i : i + 3] for i in range(0, len(grants), 3)]
        assert all(sum(g is not None for g in trio) == 1 for trio in per_record)
        # Each winner delivers; nobody can claim a delivered record again.
        for rid, trio in zip(ids, per_record, strict=True):
            owner = next(g for g in trio if g is not None)
            store = b if owner == "B" else a
            assert await store.finish(
                rid, owner, dlq_operations.Finish("delivered", True, 200, None, True), NOW
            )
        for store in (a, b):
            with pytest.raises(dlq_errors.RecordDelivered):
                await store.claim(ids[0], "late", ("pending", "parked"), 60.0, NOW + 10**6)
        with pytest.raises(dlq_errors.RecordNotFound):
            await a.claim("nope", "x", ("pending",), 60.0, NOW)
    finally:
        a.close()
        b.close()


async def test_an_expired_claim_is_taken_over_and_counts_as_possibly_sent(tmp_path):
    """A claim is a lease: one left by a dead process (never finished) blocks others until it
    expires; then anyone may take it, and the record is marked as possibly having reached
    the upstream, since nobody knows how far the dead replay got."""
    db = str(tmp_path / "dlq.sqlite3")
    store = DlqStore(db, 100, 10**6)
    store.open()
    try:
        rid = await store.add(rec("POST", key=None, reached=False))
        await store.claim(rid, "dead-process", ("pending",), 60.0, NOW)
        with pytest.raises(dlq_errors.RecordBusy):
            await store.claim(rid, "other", ("pending",), 60.0, NOW + 59.0)
        with pytest.raises(dlq_errors.RecordBusy):
            await store.delete(rid, now=NOW + 59.0)
        taken = await store.claim(rid, "other", ("pending",), 60.0, NOW + 60.0)
        assert taken["claimed_by"] == "other" and taken["reached_upstream"] is True
        # The dead owner's late answer is not recorded.
        assert not await store.finish(
            rid, "dead-process", dlq_operations.Finish("delivered", True, 200, None, True), NOW + 61
        )
        assert await store.finish(
            rid, "other", dlq_operations.Finish("pending", True, 503, None, False), NOW + 61
        )
        r = await store.get(rid)
        assert r is not None and r["status"] == "pending" and r["claimed_by"] is None
        with pytest.raises(dlq_errors.RecordNotInStatus):
            await store.claim(rid, "x", ("parked",), 60.0, NOW + 62)
    finally:
        store.close()


async def test_a_delivered_record_cannot_be_replayed_again(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    async with client.put(sc.url + "/o", data=b"1") as resp:
        rid = resp.headers["x-retry-dlq-id"]
    up.script = [reply(200)]
    async with client.post(admin(sc) + f"/dlq/{rid}/replay") as resp:
        assert (await resp.json())["status"] == "delivered"
    up.seen.clear()
    for _ in range(2):
        async with client.post(admin(sc) + f"/dlq/{rid}/replay") as resp:
            assert resp.status == 409
            assert "delivered already" in (await resp.json())["error"]
    async with client.post(admin(sc) + "/dlq/replay", json={"status": "parked"}) as resp:
        assert (await resp.json())["replayed"] == []
    assert up.seen == []


# -- two processes sharing one file ---------------------------------------------------------


def process_config(up_url: str, db: Path, port: int, admin_port: int) -> str:
    return f"""
version: 1
name: p{port}
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin_port}"}}
dlq: {{path: "{db}"}}
defaults:
  retry: {{attempts: 1}}
  breaker: {{min_sequences: 100000}}
  dlq: {{enabled: true, max_replays: 1000, replay_rate: 1000, redrive: {{enabled: true, interval: 1s}}}}
routes:
  - name: main
    upstream: "{up_url}"
"""


@pytest.mark.slow
async def test_two_processes_sharing_a_file_deliver_every_record_exactly_once(
    upstream_factory, tmp_path
):
    """Two sidecar processes on one DLQ file, each running its redrive, while batch replays
    are fired at both admin APIs: every record is delivered, none twice."""
    delivered: list[str] = []
    healthy = False

    async def upstream(request: web.Request) -> web.StreamResponse:
        if not healthy:
            return web.Response(status=503)
        await asyncio.sleep(0.05)  # widen every window between claim and answer
        rid = request.headers.get("x-retry-replay")
        if rid:
            delivered.append(rid)
        return web.Response(status=200)

    up = await upstream_factory(upstream)
    db = tmp_path / "dlq.sqlite3"
    procs, ports = [], []
    for i in range(2):
        port, admin_port = free_port(), free_port()
        cfg = tmp_path / f"sidecar{i}.yaml"
        cfg.write_text(process_config(up.url, db, port, admin_port))
        p = SidecarProcess(cfg)
        p.start()
        procs.append(p)
        ports.append((port, admin_port))
    try:
        for p, (port, admin_port) in zip(procs, ports, strict=True):
            await p.wait_port(port, admin_port)
        ids = []
        async with aiohttp.ClientSession() as s:
            for i in range(12):
                async with s.post(
                    f"http://127.0.0.1:{ports[i % 2][0]}/orders",
                    data=b"%d" % i,
                    headers={"Idempotency-Key": f"order-{i}"},
                ) as r:
                    assert r.headers["x-retry-dlq"] == "stored"
                    ids.append(r.headers["x-retry-dlq-id"])
            healthy = True
            batches = [
                s.post(f"http://127.0.0.1:{a}/dlq/replay", json={"limit": 100})
                for _ in range(2)
                for _, a in ports
            ]
            for resp in await asyncio.gather(*batches):
                assert resp.status == 200
                resp.release()

            def all_delivered() -> bool:
                conn = sqlite3.connect(db)
                try:
                    n: int = conn.execute(
                        "SELECT COUNT(*) FROM records WHERE status = 'delivered'"
                    ).fetchone()[0]
                    return n == len(ids)
                finally:
                    conn.close()

            await eventually(all_delivered, timeout=20.0)
            await asyncio.sleep(1.5)  # a redrive round more on each process
        counts = Counter(delivered)
        assert sorted(counts) == sorted(ids)
        assert [rid for rid, n in counts.items() if n > 1] == []
    finally:
        for p in procs:
            assert p.terminate() == 0


async def test_a_crashed_replay_leaves_a_claim_that_expires(upstream_factory, tmp_path):
    """SIGKILL while a replay waits on the upstream: the claim stays in the file (nobody else
    sends the record meanwhile) until its lease expires; then it can be claimed again, and the
    record counts as possibly sent."""
    seen_replay = asyncio.Event()

    async def hang_replays(request: web.Request) -> web.StreamResponse:
        if request.headers.get("x-retry-replay"):
            seen_replay.set()
            await asyncio.sleep(60)
        return web.Response(status=503)

    up = await upstream_factory(hang_replays)
    db = tmp_path / "dlq.sqlite3"
    port, admin_port = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        process_config(up.url, db, port, admin_port).replace(
            "redrive: {enabled: true, interval: 1s}", "redrive: {enabled: false}"
        )
    )
    proc = SidecarProcess(cfg)
    proc.start()
    try:
        await proc.wait_port(port, admin_port)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"http://127.0.0.1:{port}/o", data=b"x") as r:
                rid = r.headers["x-retry-dlq-id"]
            conn = sqlite3.connect(db)  # as if it had never reached the upstream
            conn.execute("UPDATE records SET reached_upstream = 0 WHERE id = ?", (rid,))
            conn.commit()
            conn.close()
            replay = asyncio.create_task(s.post(f"http://127.0.0.1:{admin_port}/dlq/{rid}/replay"))
            await asyncio.wait_for(seen_replay.wait(), 10)
            assert proc.proc is not None
            proc.proc.kill()
            proc.proc.wait()
            with pytest.raises(aiohttp.ClientError):
                await replay
    finally:
        proc.terminate()
    left = row(db, rid)
    assert left["claimed_by"] is not None and left["status"] == "pending"
    assert left["reached_upstream"] == 0  # the dead replay could not record anything
    expires = left["claim_expires_at"]
    store = DlqStore(str(db), 100, 10**6)
    store.open()
    try:
        with pytest.raises(dlq_errors.RecordBusy):
            await store.claim(rid, "successor", ("pending",), 60.0, expires - 1.0)
        taken = await store.claim(rid, "successor", ("pending",), 60.0, expires)
        assert taken["reached_upstream"] is True and taken["body_bytes"] == b"x"
    finally:
        store.close()


# -- cancellation half-way ----------------------------------------------------------------


async def test_cancelling_a_replay_half_way_gives_its_claim_back(
    upstream_factory, sidecar_factory, client, tmp_path
):
    seen = asyncio.Event()

    async def hang(request: web.Request) -> web.StreamResponse:
        seen.set()
        await asyncio.sleep(30)
        return web.Response(status=200)

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, retry="{attempts: 1}"))
    async with client.post(sc.url + "/o", data=b"x", headers={"Idempotency-Key": "k"}) as resp:
        rid = resp.headers["x-retry-dlq-id"]
    conn = sqlite3.connect(db)
    conn.execute("UPDATE records SET reached_upstream = 0 WHERE id = ?", (rid,))
    conn.commit()
    conn.close()
    up.script = [hang]
    replayer = sc.sidecar.replayer
    assert replayer is not None
    task = asyncio.create_task(replayer.replay_one(rid))
    await asyncio.wait_for(seen.wait(), 10)
    assert row(db, rid)["claimed_by"] == replayer.owner
    async with client.delete(admin(sc) + f"/dlq/{rid}") as resp:
        assert resp.status == 409  # no purge under a live claim
    async with client.post(admin(sc) + f"/dlq/{rid}/replay") as resp:
        assert resp.status == 409 and "being replayed" in (await resp.json())["error"]
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: row(db, rid)["claimed_by"] is None, timeout=5)
    left = row(db, rid)
    assert left["status"] == "pending" and left["replays"] == 0
    assert left["reached_upstream"] == 1  # it may have been sent
    assert sc.sidecar.states.get("main").bulkhead.in_flight == 0
    up.script = [reply(201)]
    async with client.post(admin(sc) + f"/dlq/{rid}/replay") as resp:
        assert (await resp.json())["status"] == "delivered"


async def test_a_replay_cancelled_while_its_claim_waits_on_the_disk_gives_it_back(
    upstream_factory, sidecar_factory, client, tmp_path, monkeypatch
):
    """The claim commits even if its caller is cancelled while waiting for the writer (here a
    lock held by another connection stalls it): the granted claim must still be given back."""
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    async with client.put(sc.url + "/o", data=b"x") as resp:
        rid = resp.headers["x-retry-dlq-id"]
    replayer = sc.sidecar.replayer
    assert replayer is not None
    claiming = asyncio.Event()
    real_claim = DlqStore.claim

    def claim(self: DlqStore, *args: Any) -> asyncio.Future[dict[str, Any]]:
        fut = real_claim(self, *args)  # queued to the writer, which waits for the lock
        claiming.set()
        return fut

    monkeypatch.setattr(DlqStore, "claim", claim)
    blocker = sqlite3.connect(db, isolation_level=None)
    blocker.execute("BEGIN IMMEDIATE")  # the writer's next transaction waits (busy_timeout)
    try:
        task = asyncio.create_task(replayer.replay_one(rid))
        await asyncio.wait_for(claiming.wait(), 15)  # the claim waits on the disk
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        blocker.execute("ROLLBACK")
        blocker.close()
    up.seen.clear()
    await eventually(lambda: row(db, rid)["claimed_by"] is None, timeout=5)
    assert up.seen == []  # never sent
    assert row(db, rid)["status"] == "pending"


# -- the redrive ------------------------------------------------------------------------------


def redrive_config(main_url: str, gone_url: str, db: Path, extra: str = "") -> str:
    return f"""
version: 1
name: t
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0"}}
dlq: {{path: "{db}"}}
defaults:
  retry: {{attempts: 2, per_try_timeout: 300ms, backoff: {{strategy: constant, base: 1ms, max: 1ms}}}}
  breaker: {{min_sequences: 100000}}
  dlq: {{enabled: true, max_replays: 100, redrive: {{enabled: true, interval: 1s}}}}
routes:
  - name: gone
    match: {{path_prefix: /gone}}
    upstream: "{gone_url}"
  - name: main
    upstream: "{main_url}"
{extra}
"""


async def start_at(port: int, handler) -> web.AppRunner:
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def test_redrive_resends_only_what_is_safe_and_parks_the_rest(
    upstream_factory, sidecar_factory, client, tmp_path
):
    """A keyless POST whose bytes reached the upstream (it timed out after sending) is parked
    for a human; a keyless POST that never left (connect failure) and a keyed POST are
    resent. A parked record can still be replayed by hand."""
    hanging = True
    replays: list[str] = []

    async def main(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.headers.get("x-retry-replay"):
            replays.append(request.headers["x-retry-replay"])
        if hanging:
            await asyncio.sleep(5)  # applied, but the answer comes too late
        return web.Response(status=201)

    up = await upstream_factory(main)
    gone_port = free_port()
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(redrive_config(up.url, f"http://127.0.0.1:{gone_port}", db))
    async with client.post(sc.url + "/pay", data=b"keyless") as resp:
        assert resp.headers["x-retry-fate"] == "non-idempotent"
        unsafe = resp.headers["x-retry-dlq-id"]
    async with client.post(
        sc.url + "/pay", data=b"keyed", headers={"Idempotency-Key": "p-1"}
    ) as resp:
        keyed = resp.headers["x-retry-dlq-id"]
    async with client.post(sc.url + "/gone/pay", data=b"never left") as resp:
        assert resp.headers["x-retry-proxy-error"] == "connect-failure"
        untouched = resp.headers["x-retry-dlq-id"]
    hanging = False

    async def gone_ok(request: web.Request) -> web.StreamResponse:
        if request.headers.get("x-retry-replay"):
            replays.append(request.headers["x-retry-replay"])
        return web.Response(status=200)

    gone = await start_at(gone_port, gone_ok)
    try:
        await eventually(
            lambda: (
                [row(db, r)["status"] for r in (unsafe, keyed, untouched)]
                == ["parked", "delivered", "delivered"]
            ),
            timeout=15,
        )
        parked = row(db, unsafe)
        assert "may have reached the upstream" in parked["parked_reason"]
        assert unsafe not in replays  # never resent automatically
        async with client.get(admin(sc) + f"/dlq/{unsafe}") as resp:
            shown = await resp.json()
        assert shown["status"] == "parked" and shown["reached_upstream"] is True
        assert "Idempotency-Key" in shown["parked_reason"]
        # A human may still send it.
        async with client.post(admin(sc) + f"/dlq/{unsafe}/replay") as resp:
            assert (await resp.json())["status"] == "delivered"
        assert replays.count(unsafe) == 1
    finally:
        await gone.cleanup()


@pytest.mark.slow
async def test_redrive_probes_an_open_breaker_when_clients_are_quiet(
    upstream_factory, sidecar_factory, client, tmp_path
):
    """Only an admission moves a breaker from open to half-open. With no client traffic the
    redrive must be that admission, or a route whose breaker opened never recovers."""
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    text = dlq_yaml(
        up.url,
        db,
        "{enabled: true, redrive: {enabled: true, interval: 1s}}",
        retry="{attempts: 1}",
    ).replace(
        "breaker: {min_sequences: 100000}",
        "breaker: {min_sequences: 2, open_for: 1s, half_open_probes: 2}",
    )
    sc = await sidecar_factory(text)
    ids = []
    for i in range(3):
        async with client.put(sc.url + f"/o/{i}", data=b"v") as resp:
            ids.append(resp.headers["x-retry-dlq-id"])
    assert resp.headers["x-retry-fate"] == "breaker-open"
    breaker = sc.sidecar.states.get("main").breaker
    assert breaker.state.value == "open"
    up.script = [reply(200)]
    await eventually(lambda: all(row(db, r)["status"] == "delivered" for r in ids), timeout=15)
    assert breaker.state.value == "closed"


@pytest.mark.slow
async def test_redrive_survives_storage_errors(upstream_factory, client, tmp_path, caplog):
    """A lock held on the file by someone else makes every write fail for a while; the redrive
    logs it, backs off and goes on, and delivers once the disk works again."""
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = Sidecar(
        parse_text(dlq_yaml(up.url, db, "{enabled: true, redrive: {enabled: true, interval: 1s}}"))
    )
    sc.dlqs.busy_timeout_ms = 100
    await sc.start()
    try:
        async with client.put(f"http://127.0.0.1:{sc.proxy_port}/o", data=b"v") as resp:
            rid = resp.headers["x-retry-dlq-id"]
        up.script = [reply(200)]
        caplog.set_level(logging.ERROR, logger="sidecar")
        blocker = sqlite3.connect(db, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            await eventually(
                lambda: any("DLQ write failed" in r.getMessage() for r in caplog.records),
                timeout=10,
            )
            await asyncio.sleep(1.5)  # another round or more fails too
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        await eventually(lambda: row(db, rid)["status"] == "delivered", timeout=15)
        assert "dlq-redrive" in sc.task_names()
        replays = [s for s in up.seen if s.header("x-retry-replay") == rid]
        assert len(replays) == 1  # nothing was sent while the claim could not be taken
    finally:
        await sc.stop()


# -- files from before these columns existed --------------------------------------------------

OLD_SCHEMA = """
CREATE TABLE records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE, route TEXT NOT NULL,
    status TEXT NOT NULL, method TEXT NOT NULL, target TEXT NOT NULL, headers TEXT NOT NULL,
    body BLOB NOT NULL, fate TEXT NOT NULL, attempts INTEGER NOT NULL, last_status INTEGER,
    last_error TEXT, idempotency_key TEXT, replays INTEGER NOT NULL DEFAULT 0,
    size INTEGER NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL
);
CREATE INDEX records_status_route ON records(status, route, seq);
"""


async def test_a_file_from_the_previous_version_is_migrated(tmp_path):
    from sidecar.config.model import RetryPolicy
    from sidecar.dlq.record import safe_to_resend

    db = tmp_path / "dlq.sqlite3"
    conn = sqlite3.connect(db)
    conn.executescript(OLD_SCHEMA)
    conn.execute(
        "INSERT INTO records (id, route, status, method, target, headers, body, fate, attempts, "
        "size, created_at, updated_at) VALUES ('old1', 'main', 'pending', 'POST', '/o', '[]', "
        "x'6869', 'exhausted', 3, 10, 5.0, 5.0)"
    )
    conn.commit()
    conn.close()
    stores = [DlqStore(str(db), 100, 10**6) for _ in range(2)]
    for s in stores:  # twice: opening an already migrated file changes nothing
        s.open()
    try:
        r = await stores[0].get("old1")
        assert r is not None and r["body_bytes"] == b"hi" and r["reached_upstream"] is None
        assert stores[1].counts.by_status == {"pending": 1}
        # Unknown counts as reached: a keyless POST is not resent without a human.
        assert not safe_to_resend(RetryPolicy(), "POST", r["idempotency_key"], None)
        claimed = await stores[1].claim("old1", "me", ("pending",), 60.0, NOW)
        assert claimed["claimed_by"] == "me"
    finally:
        for s in stores:
            s.close()
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone()[0] == 2
    conn.close()


def test_stores_opening_one_new_file_at_the_same_moment_all_open_it(tmp_path):
    """Sidecars sharing a DLQ file often start together. SQLite can answer "database is
    locked" at once (without waiting for the busy timeout) to one of them while another
    switches the new file to WAL or creates its schema: that one used to run its whole life
    without a DLQ (every failed write answered ``x-retry-dlq: unavailable``), and a lock met
    by the integrity check could even move a healthy file aside as corrupt."""
    import threading

    for round_ in range(15):
        path = str(tmp_path / f"dlq{round_}.sqlite3")
        stores = [DlqStore(path, 1000, 10_000_000) for _ in range(4)]
        start = threading.Barrier(len(stores))
        errors: list[BaseException] = []

        def open_it(s: DlqStore, start: threading.Barrier, errors: list[BaseException]) -> None:
            start.wait()
            try:
                s.open()
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)

        threads = [threading.Thread(target=open_it, args=(s, start, errors)) for s in stores]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        try:
            assert errors == []
            assert all(s.available and s.corrupt_moved_to is None for s in stores)
        finally:
            for s in stores:
                s.close()

"""The DLQ's disk going wrong under the real process: a full volume at a restart, the file
deleted while the sidecar runs. An acknowledged record is never lost."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import aiohttp
import pytest

from tests.conftest import reply
from tests.proc import SidecarProcess, free_port
from tests.volume import fill, small_volume
from tests.wait import until, until_async


def process_yaml(up_url: str, db: Path, port: int, admin_port: int) -> str:
    return f"""
version: 1
name: disk
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin_port}"}}
dlq: {{path: "{db}"}}
defaults:
  retry: {{attempts: 1}}
  breaker: {{min_sequences: 100000}}
  dlq: {{enabled: true}}
routes:
  - name: main
    upstream: "{up_url}"
"""


async def sidecar_on(tmp_path: Path, up_url: str, db: Path) -> tuple[SidecarProcess, int, int]:
    """The real process with its DLQ file at ``db``, started (not yet waited for): the process,
    its proxy port and its admin port. Its config is ``tmp_path / "sidecar.yaml"``."""
    port, admin_port = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(process_yaml(up_url, db, port, admin_port))
    proc = SidecarProcess(cfg)
    proc.start()
    return proc, port, admin_port


async def metric(s: aiohttp.ClientSession, admin_port: int, name: str) -> str | None:
    """The value of one unlabelled series, None when it is absent."""
    async with s.get(f"http://127.0.0.1:{admin_port}/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(name + " "):
                return line.split()[1]
    return None


async def store_writes(s: aiohttp.ClientSession, port: int, n: int) -> list[str]:
    ids = []
    for i in range(n):
        async with s.post(f"http://127.0.0.1:{port}/o/{i}", data=b"%d" % i) as r:
            assert r.headers["x-retry-dlq"] == "stored"
            ids.append(r.headers["x-retry-dlq-id"])
    return ids


def held(db: Path) -> list[str]:
    conn = sqlite3.connect(db)
    try:
        return [r[0] for r in conn.execute("SELECT id FROM records ORDER BY seq")]
    finally:
        conn.close()


@pytest.mark.slow
async def test_a_restart_on_a_full_volume_keeps_the_queue_and_opens_it_once_it_can(
    upstream_factory, tmp_path
):
    """SQLite cannot create the ``-shm`` on a full volume, so the integrity check fails with
    an I/O error: that is no damage. The file stays where it is, writes are refused as
    ``unavailable`` (the proxy keeps serving, the gauge says the DLQ is unavailable), and the
    DLQ opens by itself, every acknowledged record in it, once space is freed."""
    up = await upstream_factory(reply(503))
    with small_volume(tmp_path / "vol", "2m") as vol:
        db = vol / "dlq.sqlite3"
        port, admin_port = free_port(), free_port()
        cfg = tmp_path / "sidecar.yaml"
        cfg.write_text(process_yaml(up.url, db, port, admin_port))
        first = SidecarProcess(cfg)
        first.start()
        try:
            await first.wait_port(port, admin_port)
            async with aiohttp.ClientSession() as s:
                ids = await store_writes(s, port, 8)
        finally:
            assert first.terminate() == 0
        filler = fill(vol)
        second = SidecarProcess(cfg)
        second.start()
        try:
            await second.wait_port(port, admin_port)
            async with aiohttp.ClientSession() as s:
                async with s.post(f"http://127.0.0.1:{port}/o/late", data=b"late") as r:
                    assert r.status == 503 and r.headers["x-retry-dlq"] == "unavailable"
                assert await metric(s, admin_port, "retry_sidecar_dlq_available") == "0"
                assert [p.name for p in vol.iterdir() if "corrupt" in p.name] == []
                filler.unlink()

                async def opened() -> bool:
                    return await metric(s, admin_port, "retry_sidecar_dlq_available") == "1"

                # Opening is tried again, backing off up to 30 s between tries.
                await until_async(opened, "the DLQ to open once space is freed", 60.0)
                async with s.get(f"http://127.0.0.1:{admin_port}/dlq?limit=100") as r:
                    listed = [rec["id"] for rec in (await r.json())["records"]]
                assert sorted(listed) == sorted(ids)
                assert [p.name for p in vol.iterdir() if "corrupt" in p.name] == []
        finally:
            assert second.terminate() == 0
            log = second.stderr()
        assert "moved aside" not in log
        assert held(db) == ids


async def test_a_failing_dlq_write_does_not_log_a_line_per_request(
    upstream_factory, client, tmp_path, caplog
):
    """An outage of the DLQ's disk fails every write; each one used to log its own error line
    (a thousand lines a second under load). They are rate limited as the proxy's own error
    lines are: at most 10 a minute, the next one saying how many were suppressed."""
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text
    from tests.dlq.test_dlq import dlq_yaml

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = Sidecar(parse_text(dlq_yaml(up.url, db, retry="{attempts: 1}")))
    sc.dlqs.max_page_count = 8  # SQLITE_FULL, as a full disk gives
    await sc.start()
    try:
        caplog.set_level(logging.ERROR, logger="sidecar.dlq")
        seen = []
        for _ in range(40):
            async with client.post(f"http://127.0.0.1:{sc.proxy_port}/o", data=b"z" * 3000) as r:
                seen.append(r.headers["x-retry-dlq"])
        failed = seen.count("unavailable")
        assert failed >= 30
        lines = [r for r in caplog.records if "DLQ write failed" in r.getMessage()]
        assert 1 <= len(lines) <= 10
    finally:
        await sc.stop()


async def test_a_dlq_file_deleted_while_running_is_written_again_before_anything_is_acked(
    upstream_factory, tmp_path
):
    """``rm dlq.sqlite3*`` under a running sidecar: later writes used to be acknowledged into
    the unlinked file and were gone at the next start, without a word. Now the writer notices
    (the path no longer names the file it has open) before it acknowledges, writes everything
    the open file holds to a new file at the path, says so in the log and a counter, and goes
    on: after a restart every acknowledged record is there."""
    up = await upstream_factory(reply(503))
    db = tmp_path / "data" / "dlq.sqlite3"
    proc, port, admin_port = await sidecar_on(tmp_path, up.url, db)
    try:
        await proc.wait_port(port, admin_port)
        async with aiohttp.ClientSession() as s:
            before = await store_writes(s, port, 3)
            for p in db.parent.iterdir():
                p.unlink()  # the careless operator
            after = await store_writes(s, port, 2)
            assert await metric(s, admin_port, "retry_sidecar_dlq_file_recreated_total") == "1"
            async with s.get(f"http://127.0.0.1:{admin_port}/dlq?limit=100") as r:
                listed = [rec["id"] for rec in (await r.json())["records"]]
            assert sorted(listed) == sorted(before + after)
    finally:
        assert proc.terminate() == 0
    assert "was deleted while in use" in proc.stderr()
    assert held(db) == before + after
    assert (db.stat().st_mode & 0o777) == 0o600
    again = SidecarProcess(tmp_path / "sidecar.yaml")
    again.start()
    try:
        await again.wait_port(port, admin_port)
        async with (
            aiohttp.ClientSession() as s,
            s.get(f"http://127.0.0.1:{admin_port}/dlq?limit=100") as r,
        ):
            listed = [rec["id"] for rec in (await r.json())["records"]]
        assert sorted(listed) == sorted(before + after)
    finally:
        assert again.terminate() == 0


async def test_a_dlq_file_deleted_then_a_stop_before_any_check_keeps_every_record(
    upstream_factory, tmp_path
):
    """``rm dlq.sqlite3`` and then SIGTERM before the writer's next check (every 10 s, or the
    next write): the deleted file was closed as it was, and every acknowledged record went
    with it. The writer checks the file once more before it closes it, and writes it again."""
    up = await upstream_factory(reply(503))
    db = tmp_path / "data" / "dlq.sqlite3"
    proc, port, admin_port = await sidecar_on(tmp_path, up.url, db)
    try:
        await proc.wait_port(port, admin_port)
        async with aiohttp.ClientSession() as s:
            acked = await store_writes(s, port, 5)
        db.unlink()  # the careless operator; its -wal and -shm stay
    finally:
        assert proc.terminate() == 0
    assert "was deleted while in use" in proc.stderr()
    assert held(db) == acked


@pytest.mark.slow
async def test_a_dlq_file_deleted_while_the_volume_is_full_is_written_again_once_it_has_room(
    upstream_factory, tmp_path
):
    """``rm dlq.sqlite3`` while the volume is full: the copy to a new file fails. It used to
    mark the DLQ lost for good, so the copy was never tried again -- not when space came
    back, not before the file was closed at the stop -- and every acknowledged record was
    gone after the restart. The copy is tried again at every check until it succeeds."""
    up = await upstream_factory(reply(503))
    with small_volume(tmp_path / "vol", "2m") as vol:
        db = vol / "dlq.sqlite3"
        proc, port, admin_port = await sidecar_on(tmp_path, up.url, db)
        try:
            await proc.wait_port(port, admin_port)
            async with aiohttp.ClientSession() as s:
                acked = await store_writes(s, port, 8)
            filler = fill(vol)
            db.unlink()  # the careless operator, on a full volume
            # The writer's periodic check (every 10 s) finds it deleted and cannot copy it.
            await until(
                lambda: "could not be written again" in proc.stderr(),
                "the failed copy",
                timeout=40,
            )
            filler.unlink()  # space again
        finally:
            assert proc.terminate() == 0
        assert held(db) == acked
        assert not any(".restoring" in p.name for p in vol.iterdir())  # no copy left behind


async def test_a_dlq_file_replaced_while_running_is_not_overwritten_and_acks_stop(tmp_path):
    """Another file put at the path (a restored backup, say) is not ours to overwrite or
    merge into: the DLQ stops acknowledging (unavailable) and leaves both files as they are."""
    import os
    import time

    import pytest

    from sidecar.dlq.errors import DlqUnavailable
    from sidecar.dlq.record import NewRecord
    from sidecar.dlq.store import DlqStore

    def rec() -> NewRecord:
        return NewRecord(
            route="main", method="PUT", target="/o", headers=[], body=b"v", fate="exhausted",
            attempts=1, last_status=503, last_error=None, idempotency_key="k",
            created_at=time.time(), reached_upstream=True,
        )  # fmt: skip

    db = tmp_path / "dlq.sqlite3"
    other = tmp_path / "backup.sqlite3"
    store = DlqStore(str(db), 100, 10**6)
    store.open()
    try:
        kept = await store.add(rec())
        sqlite3.connect(other).close()
        os.replace(other, db)
        with pytest.raises(DlqUnavailable):
            await store.add(rec())
        assert not store.available
        with pytest.raises(DlqUnavailable):
            await store.add(rec())
        assert not _has_table(db)  # the file put there is left as it was
    finally:
        store.close()
    assert kept


def _has_table(db: Path) -> bool:
    conn = sqlite3.connect(db)
    try:
        return (
            conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'records'").fetchone()
            is not None
        )
    finally:
        conn.close()

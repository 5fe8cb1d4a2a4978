"""What the DLQ keeps, and how: never a stand-in body, blank Idempotency-Keys, the header
deny-list, the file's permissions, and scrapes that never touch SQLite on the event loop.
Real sockets, a real sidecar, a real SQLite file."""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import threading
from pathlib import Path

from sidecar.dlq.store import DlqStore
from tests.conftest import reply
from tests.dlq.test_dlq import dlq_yaml, rows
from tests.rawhttp import raw_request
from tests.wait import until


def record(db: Path, rid: str) -> dict[str, object]:
    conn = sqlite3.connect(db)
    conn.row_factory = sqlite3.Row
    try:
        row = conn.execute("SELECT * FROM records WHERE id = ?", (rid,)).fetchone()
        return dict(row)
    finally:
        conn.close()


# -- 1. a streamed body is never stored ----------------------------------------------------


async def test_streamed_body_that_never_left_is_not_stored_or_acknowledged(
    sidecar_factory, client, tmp_path, unused_tcp_port
):
    """A body over max_body_bytes is streamed, never held whole. When the sequence ends before
    it was consumed (here: nothing listens upstream) the DLQ must not store an empty stand-in
    and acknowledge it -- a replay would send the write with Content-Length: 0."""
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(
        dlq_yaml(
            f"http://127.0.0.1:{unused_tcp_port}",
            db,
            "{enabled: true, respond: accepted}",
            retry="{attempts: 2, max_body_bytes: 16}",
        )
    )
    body = b"x" * 1000
    async with client.post(
        sc.url + "/orders", data=body, headers={"Idempotency-Key": "k1"}
    ) as resp:
        assert resp.status == 502  # never a 202 for what was not stored
        assert resp.headers["x-retry-dlq"] == "body-too-large"
        assert "x-retry-dlq-id" not in resp.headers
    # The same with chunked framing (no Content-Length).

    async def chunks():
        yield body[:500]
        yield body[500:]

    async with client.post(sc.url + "/orders", data=chunks()) as resp:
        assert resp.status == 502 and resp.headers["x-retry-dlq"] == "body-too-large"
    assert rows(db) == []
    metrics = sc.sidecar.metrics.render()
    assert 'retry_sidecar_dlq_writes_total{route="main",result="body-too-large"} 2' in metrics


async def test_streamed_body_refused_by_an_open_breaker_is_not_stored(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    text = dlq_yaml(up.url, db, retry="{attempts: 1, max_body_bytes: 16}").replace(
        "breaker: {min_sequences: 100000}", "breaker: {min_sequences: 2, open_for: 60s}"
    )
    sc = await sidecar_factory(text)
    for _ in range(2):  # small bodies, stored whole, open the breaker
        async with client.put(sc.url + "/o", data=b"small") as resp:
            assert resp.headers["x-retry-dlq"] == "stored"
    async with client.put(sc.url + "/o", data=b"y" * 100) as resp:
        assert resp.headers["x-retry-fate"] == "breaker-open"
        assert resp.headers["x-retry-dlq"] == "body-too-large"
    assert [r[4] for r in rows(db)] == [b"small", b"small"]


async def test_buffered_bodies_and_empty_bodies_are_kept_exactly(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, retry="{attempts: 1, max_body_bytes: 16}"))
    async with client.put(sc.url + "/o", data=b"z" * 16) as resp:  # exactly the limit
        assert resp.headers["x-retry-dlq"] == "stored"
    async with client.delete(sc.url + "/o/1") as resp:  # no body at all
        assert resp.headers["x-retry-dlq"] == "stored"
    assert [(r[2], r[4]) for r in rows(db)] == [("PUT", b"z" * 16), ("DELETE", b"")]


# -- 5. a blank Idempotency-Key is no key ---------------------------------------------------


async def test_blank_idempotency_key_is_not_a_key(upstream_factory, sidecar_factory, tmp_path):
    """``Idempotency-Key:`` with an empty or blank value must not make a POST resendable,
    nor be stored as the record's key."""
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, retry="{attempts: 3}"))
    port = sc.sidecar.proxy_port
    for value in (b"", b"   ", b"\t"):
        up.seen.clear()
        raw = await raw_request(
            port,
            b"POST /pay HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
            b"Idempotency-Key: " + value + b"\r\n\r\n{}",
        )
        head = raw.split(b"\r\n\r\n", 1)[0].lower()
        assert b"x-retry-fate: non-idempotent" in head, (value, head)
        assert b"x-retry-attempts: 1" in head
        assert len(up.seen) == 1  # the POST was not resent
    assert [r[6] for r in rows(db)] == [None, None, None]
    # A real key still is one.
    up.seen.clear()
    raw = await raw_request(
        port,
        b"POST /pay HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 2\r\n"
        b"Idempotency-Key:  k-1 \r\n\r\n{}",
    )
    assert b"x-retry-attempts: 3" in raw.lower() and len(up.seen) == 3
    assert rows(db)[-1][6] == "k-1"


# -- 6. the header deny-list and the file's permissions -------------------------------------


async def test_drop_headers_are_never_stored(upstream_factory, sidecar_factory, client, tmp_path):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(
        dlq_yaml(up.url, db, "{enabled: true, drop_headers: [X-Api-Key, x-session]}")
    )
    async with client.put(
        sc.url + "/o",
        data=b"1",
        headers={
            "X-API-KEY": "secret-1",
            "X-Session": "secret-2",
            "Authorization": "Bearer secret-3",
            "X-Tenant": "acme",
        },
    ) as resp:
        assert resp.headers["x-retry-dlq"] == "stored"
    stored = json.dumps(rows(db)[0][5])
    assert "secret" not in stored and "acme" in stored


def test_drop_headers_must_be_header_names():
    import pytest

    from sidecar.config.errors import ConfigError
    from sidecar.config.parse import parse_text

    text = dlq_yaml("http://127.0.0.1:1", Path("/tmp/x.sqlite3"), "{drop_headers: [ok, 'b a d']}")
    with pytest.raises(ConfigError) as err:
        parse_text(text)
    assert "routes[0].dlq.drop_headers" in "\n".join(err.value.lines())


async def test_dlq_file_and_its_wal_are_owner_only(tmp_path):
    from sidecar.dlq.record import NewRecord

    old = os.umask(0o022)  # a common default: files would be world-readable
    try:
        db = tmp_path / "new-dir" / "dlq.sqlite3"
        store = DlqStore(str(db), 100, 10**6)
        store.open()
        try:
            await store.add(
                NewRecord("r", "PUT", "/x", [], b"b", "exhausted", 1, 503, None, None, 1.0)
            )
            for suffix in ("", "-wal", "-shm"):
                mode = stat.S_IMODE(os.stat(str(db) + suffix).st_mode)
                assert mode == 0o600, (suffix, oct(mode))
            assert stat.S_IMODE(os.stat(db.parent).st_mode) == 0o700
        finally:
            store.close()
    finally:
        os.umask(old)


def test_an_existing_world_readable_file_is_tightened(tmp_path):
    db = tmp_path / "dlq.sqlite3"
    sqlite3.connect(db).close()
    os.chmod(db, 0o644)
    store = DlqStore(str(db), 100, 10**6)
    store.open()
    try:
        assert stat.S_IMODE(os.stat(db).st_mode) == 0o600
    finally:
        store.close()


# -- 7. /metrics never runs SQLite on the event loop ----------------------------------------


async def test_metrics_scrapes_do_not_query_sqlite_on_the_loop(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    for _ in range(2):
        async with client.put(sc.url + "/o", data=b"1") as resp:
            assert resp.headers["x-retry-dlq"] == "stored"
    store = sc.sidecar.dlq
    assert store is not None
    on_loop: list[str] = []
    loop_thread = threading.get_ident()

    def trace(sql: str) -> None:
        if threading.get_ident() == loop_thread:
            on_loop.append(sql)

    assert store._reader is not None  # the connection reads run on
    store._reader.set_trace_callback(trace)
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    for _ in range(3):
        async with client.get(admin + "/metrics") as resp:
            text = await resp.text()
    assert on_loop == []
    assert 'retry_sidecar_dlq_records{status="pending"} 2' in text
    age = [line for line in text.splitlines() if line.startswith("retry_sidecar_dlq_oldest")]
    assert len(age) == 1 and float(age[0].split()[1]) >= 0.0
    # The list endpoint reads the file, off the loop.
    async with client.get(admin + "/dlq") as resp:
        assert len((await resp.json())["records"]) == 2
    assert on_loop == []


async def test_gauges_follow_other_processes_writing_the_same_file(tmp_path, monkeypatch):
    """The writer thread recounts the file every REFRESH_EVERY seconds, so what another
    process sharing the file stored shows up in this one's gauges."""

    from sidecar.dlq import store as store_mod
    from sidecar.dlq.record import NewRecord

    monkeypatch.setattr(store_mod, "REFRESH_EVERY", 0.2)
    db = tmp_path / "dlq.sqlite3"
    mine, theirs = DlqStore(str(db), 100, 10**6), DlqStore(str(db), 100, 10**6)
    mine.open()
    theirs.open()
    try:
        rec = NewRecord("r", "PUT", "/x", [], b"b", "exhausted", 1, 503, None, None, 1000.0)
        await theirs.add(rec)
        await theirs.add(rec)
        await until(
            lambda: mine.counts.by_status.get("pending") == 2, "the other process's records"
        )
        assert mine.counts.oldest_pending == 1000.0
    finally:
        mine.close()
        theirs.close()


# -- 7. reached_upstream says what the attempts did -----------------------------------------


async def test_writes_whose_every_attempt_failed_to_connect_are_stored_as_never_reached(
    upstream_factory, sidecar_factory, tmp_path
):
    """A resendable write (a DELETE, a POST with a key) retried three times against a port
    nobody listens on never left the sidecar: its record says ``reached_upstream`` false, as
    docs/dlq.md promises; it said true whenever there was more than one attempt. One attempt
    that got an answer (here a 503 from the first endpoint, then a connect failure on the
    second) makes it true."""
    from tests.proc import free_port

    dead = f"http://127.0.0.1:{free_port()}"
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(dead, db, retry="{attempts: 3}"))
    port = sc.sidecar.proxy_port
    for head in (
        b"DELETE /item/1 HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
        b"POST /pay HTTP/1.1\r\nHost: x\r\nConnection: close\r\nIdempotency-Key: k-1\r\n"
        b"Content-Length: 2\r\n\r\n{}",
    ):
        raw = await raw_request(port, head)
        assert b"x-retry-attempts: 3" in raw.lower() and b"x-retry-dlq: stored" in raw.lower()
    ids = [r[0] for r in rows(db)]
    assert len(ids) == 2
    assert [record(db, rid)["reached_upstream"] for rid in ids] == [0, 0]

    up = await upstream_factory(reply(503))
    db2 = tmp_path / "dlq2.sqlite3"
    text = dlq_yaml(up.url, db2, retry="{attempts: 2}").replace(
        f'upstream: "{up.url}"', f'upstream: ["{up.url}", "{dead}"]'
    )
    sc2 = await sidecar_factory(text)
    raw = await raw_request(
        sc2.sidecar.proxy_port,
        b"DELETE /item/2 HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Length: 0\r\n\r\n",
    )
    assert b"x-retry-attempts: 2" in raw.lower() and len(up.seen) == 1
    [only] = [r[0] for r in rows(db2)]
    assert record(db2, only)["reached_upstream"] == 1

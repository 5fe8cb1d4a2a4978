"""The dead-letter queue over real sockets and a real SQLite file."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from yarl import URL

from sidecar.dlq.errors import DlqUnavailable
from sidecar.dlq.store import DlqStore
from tests.conftest import reply, routes_yaml
from tests.wait import until

WRITE = {
    "Idempotency-Key": "order-77",
    "Authorization": "Bearer user-secret",
    "Cookie": "s=1",
    "X-Tenant": "acme",
}


def dlq_yaml(
    up_url: str,
    db: Path,
    route_dlq: str = "{enabled: true}",
    top: str = "",
    retry: str = "{attempts: 2}",
) -> str:
    return routes_yaml(
        up_url,
        f"    retry: {retry}\n    dlq: {route_dlq}\n    breaker: {{min_sequences: 100000}}",
        top_extra=f'dlq: {{path: "{db}"}}\n{top}',
    )


def rows(db: Path) -> list[tuple[Any, ...]]:
    conn = sqlite3.connect(db)
    try:
        return conn.execute(
            "SELECT id, status, method, target, body, headers, idempotency_key, fate FROM records ORDER BY seq"
        ).fetchall()
    finally:
        conn.close()


def admin(sc) -> str:
    return f"http://127.0.0.1:{sc.sidecar.admin_port}"


async def test_failed_write_is_stored_and_acknowledged(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503, b"down"))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    url = URL(sc.url + "/orders?x=%2F", encoded=True)  # the raw target, as sent
    async with client.post(url, data=b'{"qty": 2}', headers=WRITE) as resp:
        assert resp.status == 503 and await resp.read() == b"down"  # passthrough
        assert resp.headers["x-retry-fate"] == "exhausted"
        assert resp.headers["x-retry-dlq"] == "stored"
        rid = resp.headers["x-retry-dlq-id"]
    # Durable before the answer: another connection sees it at once.
    [(got_id, status, method, target, body, headers, idem, fate)] = rows(db)
    assert (got_id, status, method, target, body, idem, fate) == (
        rid,
        "pending",
        "POST",
        "/orders?x=%2F",
        b'{"qty": 2}',
        "order-77",
        "exhausted",
    )
    names = {h[0].lower() for h in json.loads(headers)}
    assert "x-tenant" in names and "idempotency-key" in names
    assert "authorization" not in names and "cookie" not in names


async def test_keep_credentials_keeps_them(upstream_factory, sidecar_factory, client, tmp_path):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, "{enabled: true, keep_credentials: true}"))
    async with client.put(sc.url + "/o/1", data=b"x", headers=WRITE) as resp:
        assert resp.headers["x-retry-dlq"] == "stored"
    names = {h[0].lower() for h in json.loads(rows(db)[0][5])}
    assert {"authorization", "cookie"} <= names


async def test_respond_accepted_gives_202_with_the_id(
    upstream_factory, sidecar_factory, client, tmp_path, unused_tcp_port
):
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(
        dlq_yaml(f"http://127.0.0.1:{unused_tcp_port}", db, "{enabled: true, respond: accepted}")
    )
    async with client.post(
        sc.url + "/orders", data=b"{}", headers={"Idempotency-Key": "k"}
    ) as resp:
        assert resp.status == 202
        body = await resp.json()
        assert resp.headers["x-retry-dlq-id"] == body["dlq_id"]
        assert resp.headers["x-retry-fate"] == "exhausted"
    assert rows(db)[0][0] == body["dlq_id"]


async def test_what_is_not_stored(upstream_factory, sidecar_factory, client, tmp_path):
    up = await upstream_factory(reply(400, b"bad input"))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    async with client.post(sc.url + "/o", data=b"{}") as resp:
        assert resp.status == 400 and "x-retry-dlq" not in resp.headers  # the caller's answer
    up.script = [reply(503)]
    async with client.get(sc.url + "/o") as resp:
        assert resp.status == 503 and "x-retry-dlq" not in resp.headers  # not a write
    up.script = [reply(201)]
    async with client.post(sc.url + "/o", data=b"{}") as resp:
        assert resp.status == 201 and "x-retry-dlq" not in resp.headers
    assert rows(db) == []


async def test_body_over_max_body_bytes_is_not_stored_and_says_so(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, retry="{attempts: 2, max_body_bytes: 10}"))
    async with client.post(
        sc.url + "/o", data=b"y" * 100, headers={"Idempotency-Key": "k"}
    ) as resp:
        assert resp.status == 503
        assert resp.headers["x-retry-dlq"] == "body-too-large"
        assert resp.headers["x-retry-fate"] == "body-too-large"
    assert rows(db) == []


async def test_breaker_open_writes_are_stored(upstream_factory, sidecar_factory, client, tmp_path):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    text = dlq_yaml(up.url, db).replace(
        "breaker: {min_sequences: 100000}", "breaker: {min_sequences: 2}"
    )
    sc = await sidecar_factory(text)
    for _ in range(3):
        async with client.post(sc.url + "/o", data=b"{}") as resp:
            last = dict(resp.headers)
    assert last["x-retry-fate"] == "breaker-open" and last["x-retry-dlq"] == "stored"
    assert [r[7] for r in rows(db)] == ["non-idempotent", "non-idempotent", "breaker-open"]


async def test_full_dlq_refuses_new_records_and_keeps_old_ones(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(
        dlq_yaml(up.url, db, "{enabled: true, respond: accepted}", top="").replace(
            f'dlq: {{path: "{db}"}}', f'dlq: {{path: "{db}", max_records: 2}}'
        )
    )
    ids = []
    for i in range(3):
        async with client.post(sc.url + "/o", data=b"%d" % i) as resp:
            ids.append((resp.status, resp.headers.get("x-retry-dlq")))
    assert ids[:2] == [(202, "stored"), (202, "stored")]
    assert ids[2] == (503, "full")  # never a 202 when not stored
    assert [r[4] for r in rows(db)] == [b"0", b"1"]
    text = sc.sidecar.metrics.render()
    assert 'retry_sidecar_dlq_writes_total{route="main",result="full"} 1' in text
    assert 'retry_sidecar_dlq_records{status="pending"} 2' in text


async def test_disk_full_is_reported_and_the_proxy_keeps_serving(
    upstream_factory, tmp_path, client
):
    """SQLite's max_page_count gives the same SQLITE_FULL error a full disk does."""
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = Sidecar(parse_text(dlq_yaml(up.url, db)))
    sc.dlqs.max_page_count = 8
    await sc.start()
    try:
        seen = []
        for _ in range(6):
            async with client.post(f"http://127.0.0.1:{sc.proxy_port}/o", data=b"z" * 3000) as resp:
                seen.append(resp.headers["x-retry-dlq"])
        assert "stored" in seen and seen[-1] == "unavailable"
        up.script = [reply(200, b"still serving")]
        async with client.post(f"http://127.0.0.1:{sc.proxy_port}/o", data=b"z") as resp:
            assert resp.status == 200 and await resp.read() == b"still serving"
        stored = sum(1 for s in seen if s == "stored")
        assert len(rows(db)) == stored  # every acknowledged record is there
    finally:
        await sc.stop()


def test_corrupt_file_is_moved_aside_not_truncated(tmp_path):
    db = tmp_path / "dlq.sqlite3"
    garbage = b"this is not a database" * 500
    db.write_bytes(garbage)
    store = DlqStore(str(db), 10, 10**6)
    store.open()
    try:
        assert store.corrupt_moved_to is not None
        assert Path(store.corrupt_moved_to).read_bytes() == garbage
        assert rows(db) == []
    finally:
        store.close()


async def test_replay_delivers_with_the_same_idempotency_key(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    async with client.post(sc.url + "/orders", data=b'{"a": 1}', headers=WRITE) as resp:
        rid = resp.headers["x-retry-dlq-id"]
    up.script = [reply(201, b"created")]
    up.seen.clear()
    async with client.post(admin(sc) + f"/dlq/{rid}/replay") as resp:
        assert resp.status == 200
        out = await resp.json()
    assert out["status"] == "delivered" and out["http_status"] == 201
    [seen] = up.seen
    assert seen.method == "POST" and seen.raw_path == "/orders" and seen.body == b'{"a": 1}'
    assert seen.header("Idempotency-Key") == "order-77"
    assert seen.header("x-retry-replay") == rid
    assert seen.header("Authorization") is None
    async with client.get(admin(sc) + f"/dlq/{rid}") as resp:
        rec = await resp.json()
    assert rec["status"] == "delivered" and rec["replays"] == 1 and rec["body"] == '{"a": 1}'


async def test_a_client_cannot_send_the_replay_marker(
    upstream_factory, sidecar_factory, client, tmp_path
):
    """x-retry-replay tells an upstream that this is a DLQ replay; only the sidecar's own
    replays may say so -- not a client, not even one from a trusted (loopback) address."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(dlq_yaml(up.url, tmp_path / "dlq.sqlite3"))
    async with client.post(
        sc.url + "/o", data=b"{}", headers={"X-Retry-Replay": "0123", "X-Other": "kept"}
    ) as resp:
        assert resp.status == 200
    [seen] = up.seen
    assert seen.header("x-retry-replay") is None and seen.header("x-other") == "kept"


async def test_replay_4xx_parks_and_repeated_failures_park(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, "{enabled: true, max_replays: 2}"))
    ids = []
    for _ in range(2):
        async with client.post(sc.url + "/o", data=b"{}", headers={"Idempotency-Key": "k"}) as resp:
            ids.append(resp.headers["x-retry-dlq-id"])
    up.script = [reply(422)]
    async with client.post(admin(sc) + f"/dlq/{ids[0]}/replay") as resp:
        assert (await resp.json())["status"] == "parked"
    up.script = [reply(503)]
    statuses = []
    for _ in range(2):
        async with client.post(admin(sc) + f"/dlq/{ids[1]}/replay") as resp:
            statuses.append((await resp.json())["status"])
    assert statuses == ["pending", "parked"]


async def test_batch_replay_dry_run_list_and_purge(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db, "{enabled: true, replay_rate: 1000}"))
    ids = []
    for i in range(3):
        async with client.delete(sc.url + f"/items/{i}") as resp:
            ids.append(resp.headers["x-retry-dlq-id"])
    async with client.get(admin(sc) + "/dlq", params={"limit": "2", "order": "oldest"}) as resp:
        page = await resp.json()
    assert [r["id"] for r in page["records"]] == ids[:2] and page["next"]
    assert set(page["records"][0]) >= {
        "id",
        "route",
        "status",
        "method",
        "target",
        "fate",
        "attempts",
        "replays",
        "created_at",
    }
    async with client.get(
        admin(sc) + "/dlq", params={"limit": "2", "order": "oldest", "cursor": page["next"]}
    ) as resp:
        assert [r["id"] for r in (await resp.json())["records"]] == ids[2:]
    async with client.post(admin(sc) + "/dlq/replay", json={"dry_run": True}) as resp:
        assert (await resp.json())["would_replay"] == ids
    assert rows(db)[0][1] == "pending"
    up.script = [reply(204)]
    async with client.post(admin(sc) + "/dlq/replay", json={"route": "main", "limit": 2}) as resp:
        done = (await resp.json())["replayed"]
    assert [d["status"] for d in done] == ["delivered", "delivered"]
    async with client.get(admin(sc) + "/dlq", params={"status": "pending"}) as resp:
        assert [r["id"] for r in (await resp.json())["records"]] == ids[2:]
    async with client.delete(admin(sc) + f"/dlq/{ids[2]}") as resp:
        assert resp.status == 200
    async with client.delete(admin(sc) + f"/dlq/{ids[2]}") as resp:
        assert resp.status == 404
    async with client.get(admin(sc) + "/dlq", params={"status": "bogus"}) as resp:
        assert resp.status == 400


async def test_one_record_is_never_replayed_twice_at_once(
    upstream_factory, sidecar_factory, client, tmp_path
):
    release = asyncio.Event()

    async def held_ok(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(status=200)

    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    async with client.put(sc.url + "/o", data=b"1") as resp:
        rid = resp.headers["x-retry-dlq-id"]
    up.script = [held_ok]
    calls = len(up.seen)
    first = asyncio.create_task(client.post(admin(sc) + f"/dlq/{rid}/replay"))
    # The first replay has claimed the record and is at the upstream, held there.
    await until(lambda: len(up.seen) == calls + 1, "the first replay to reach the upstream")
    async with client.post(admin(sc) + f"/dlq/{rid}/replay") as resp:
        assert resp.status == 409
    assert len(up.seen) == calls + 1
    release.set()
    r1 = await first
    assert (await r1.json())["status"] == "delivered"
    r1.release()


async def test_every_dlq_route_needs_the_token(
    upstream_factory, sidecar_factory, client, tmp_path, monkeypatch
):
    """The list shows targets with query strings and Idempotency-Keys, a record its body:
    with a token set, no /dlq call -- reads included -- answers without it."""
    monkeypatch.setenv("DLQ_TEST_TOKEN", "tok")
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    text = dlq_yaml(up.url, db).replace(
        'admin: {listen: "127.0.0.1:0"}',
        'admin: {listen: "127.0.0.1:0", token_env: DLQ_TEST_TOKEN}',
    )
    sc = await sidecar_factory(text)
    async with client.put(
        sc.url + "/o?account=42", data=b"secret body", headers={"Idempotency-Key": "key-9"}
    ) as resp:
        rid = resp.headers["x-retry-dlq-id"]
    calls = [
        ("GET", "/dlq"),
        ("GET", "/dlq?status=pending"),
        ("GET", f"/dlq/{rid}"),
        ("POST", f"/dlq/{rid}/replay"),
        ("POST", "/dlq/replay"),
        ("DELETE", f"/dlq/{rid}"),
    ]
    for method, path in calls:
        for auth in ({}, {"Authorization": "Bearer wrong"}):
            async with client.request(method, admin(sc) + path, headers=auth) as resp:
                text_ = await resp.text()
                assert resp.status == 401, (method, path, resp.status)
                assert "key-9" not in text_ and "account=42" not in text_ and "secret" not in text_
    assert rows(db)[0][1] == "pending"  # nothing was replayed or purged
    ok = {"Authorization": "Bearer tok"}
    async with client.get(admin(sc) + "/dlq", headers=ok) as resp:
        assert resp.status == 200
        [listed] = (await resp.json())["records"]
        assert listed["target"] == "/o?account=42" and listed["idempotency_key"] == "key-9"
    async with client.get(admin(sc) + f"/dlq/{rid}", headers=ok) as resp:
        assert resp.status == 200 and (await resp.json())["body"] == "secret body"


async def test_binary_bodies_come_back_as_base64(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(dlq_yaml(up.url, db))
    async with client.put(sc.url + "/o", data=b"\xff\x00\xfe") as resp:
        rid = resp.headers["x-retry-dlq-id"]
    async with client.get(admin(sc) + f"/dlq/{rid}") as resp:
        rec = await resp.json()
    assert rec["body_base64"] == "/wD+" and "body" not in rec


async def test_redrive_replays_pending_records_when_the_breaker_is_closed(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    db = tmp_path / "dlq.sqlite3"
    sc = await sidecar_factory(
        dlq_yaml(up.url, db, "{enabled: true, redrive: {enabled: true, interval: 1s}}")
    )
    async with client.put(sc.url + "/o", data=b"r") as resp:
        rid = resp.headers["x-retry-dlq-id"]
    up.script = [reply(200)]
    await until(lambda: rows(db)[0][1] == "delivered", "the redrive to deliver the record")
    assert rows(db)[0][:2] == (rid, "delivered")


async def test_no_dlq_file_without_a_dlq_route(upstream_factory, sidecar_factory, client, tmp_path):
    up = await upstream_factory(reply(503))
    db = tmp_path / "never.sqlite3"
    sc = await sidecar_factory(routes_yaml(up.url, top_extra=f'dlq: {{path: "{db}"}}'))
    async with client.post(sc.url + "/o", data=b"{}") as resp:
        assert "x-retry-dlq" not in resp.headers
    async with client.get(admin(sc) + "/dlq") as resp:
        assert resp.status == 503
    assert not db.exists()


async def test_delivered_records_are_pruned_after_the_audit_window(tmp_path):
    from sidecar.dlq.operations import Finish
    from sidecar.dlq.record import NewRecord

    store = DlqStore(str(tmp_path / "d.sqlite3"), 100, 10**6)
    store.open()
    try:
        rec = NewRecord("r", "PUT", "/x", [], b"b", "exhausted", 1, 503, None, None, 1000.0)
        keep = await store.add(rec)
        gone = await store.add(rec)
        await store.claim(gone, "me", ("pending",), 60.0, 1000.0)
        assert await store.finish(gone, "me", Finish("delivered", True, 200, None, True), 1001.0)
        assert store.by_status == {"pending": 1, "delivered": 1}
        assert await store.prune_delivered(older_than=4_000_000_000.0) == 1
        assert await store.get(gone) is None and await store.get(keep) is not None
        assert store.by_status["delivered"] == 0 and store.held_records == 1
    finally:
        store.close()


async def test_unusable_dlq_path_means_unavailable_and_the_proxy_keeps_serving(
    upstream_factory, sidecar_factory, client, tmp_path
):
    up = await upstream_factory(reply(503))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("a file where the DLQ directory should be")
    sc = await sidecar_factory(
        dlq_yaml(up.url, not_a_dir / "dlq.sqlite3", "{enabled: true, respond: accepted}")
    )
    async with client.post(sc.url + "/o", data=b"{}") as resp:
        assert resp.status == 503  # never a 202 without a durable record
        assert resp.headers["x-retry-dlq"] == "unavailable"
    up.script = [reply(200)]
    async with client.post(sc.url + "/o", data=b"{}") as resp:
        assert resp.status == 200
    assert (
        'retry_sidecar_dlq_writes_total{route="main",result="unavailable"} 1'
        in sc.sidecar.metrics.render()
    )


async def test_an_id_drawn_twice_in_one_millisecond_refuses_nothing(tmp_path, monkeypatch):
    """Ids are milliseconds plus 32 random bits; when two records of one group draw the same
    one, the second draws again -- a UNIQUE violation must not refuse the whole group."""
    from sidecar.dlq import operations
    from sidecar.dlq.record import NewRecord

    drawn = iter(["0001aaaa", "0001aaaa", "0001bbbb", "0001cccc"])
    monkeypatch.setattr(operations, "new_id", lambda now: next(drawn))
    store = DlqStore(str(tmp_path / "d.sqlite3"), 100, 10**6)
    store.open()
    try:
        rec = NewRecord("r", "PUT", "/x", [], b"b", "exhausted", 1, 503, None, None, 1000.0)
        ids = await asyncio.gather(store.add(rec), store.add(rec), store.add(rec))
        assert sorted(ids) == ["0001aaaa", "0001bbbb", "0001cccc"]
    finally:
        store.close()


def test_closing_the_store_while_an_admin_read_waits_gives_unavailable_not_a_crash(tmp_path):
    """An admin read (GET /dlq, run in a worker thread) waiting for the reader while the
    sidecar stops and closes the store: it gets its rows or DlqUnavailable (a clean 503),
    never an AttributeError on a reader closed under it. The read checked for the reader
    before taking the lock, and close() did not take it at all."""
    store = DlqStore(str(tmp_path / "d.sqlite3"), 100, 10**6)
    store.open()
    outcome: list[object] = []

    def read() -> None:
        try:
            outcome.append(store._read("SELECT count(*) FROM records", ()))
        except Exception as exc:  # what the admin API would see
            outcome.append(exc)

    try:
        with store._read_lock:  # a read already running holds the reader
            reader = threading.Thread(target=read)
            reader.start()
            time.sleep(0.05)  # the second read is now waiting for the lock
            closer = threading.Thread(target=store.close)
            closer.start()
            closer.join(0.2)  # (it waits for the lock too, now)
        reader.join(5)
        closer.join(5)
        assert not reader.is_alive() and not closer.is_alive()
        assert len(outcome) == 1
        assert outcome[0] == [(0,)] or isinstance(outcome[0], DlqUnavailable), outcome
    finally:
        store.close()

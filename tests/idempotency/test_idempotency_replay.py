"""What a replay carries, against the real sidecar process: one ``Date`` and one
``Proxy-Status`` (the sidecar's own replace the kept ones, also on a replayed DLQ 202); and a kept
answer read back from the store (SQLite, a real redis-server) is checked before it is written:
one whose fields were tampered with (CR LF in a value, a name that is no token, a framing field,
a status out of range...) is a store error (503 ``store-unavailable`` under the default
``on_store_error: refuse``), and no split response reaches the client's socket."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from redis.asyncio import Redis

from sidecar.idempotency.fingerprint import NO_SCOPE, stored_key
from tests.idempotency.test_idempotency_fleet import fleet_config
from tests.idempotency.test_idempotency_process import WriteApp, config, start
from tests.idempotency.test_idempotency_process import app as app
from tests.idempotency.test_idempotency_process import proc_stack as proc_stack
from tests.proc import SidecarProcess
from tests.rawhttp import raw_request
from tests.redisserver import RedisServer, running

pytestmark = pytest.mark.slow


def write(key: bytes) -> bytes:
    return (
        b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: %s\r\n"
        b"Connection: close\r\nContent-Length: 2\r\n\r\n{}" % key
    )


def fields(raw: bytes, name: bytes) -> list[bytes]:
    head = raw.split(b"\r\n\r\n", 1)[0]
    return [
        line.split(b":", 1)[1].strip()
        for line in head.split(b"\r\n")[1:]
        if line.split(b":", 1)[0].lower() == name
    ]


async def test_a_replay_carries_one_date_and_one_proxy_status(
    app: WriteApp, tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    """The app's answer has its own Date (aiohttp sends one): the replay carries one Date, not
    the kept one beside the sidecar's. A write the DLQ stored was answered 202 with the
    sidecar's Proxy-Status: its replay carries one Proxy-Status."""
    extra = (
        "  - name: queued\n"
        "    match: {path_prefix: /queued}\n"
        f'    upstream: "http://127.0.0.1:{app.port}"\n'
        "    idempotency: {enabled: true}\n"
        "    dlq: {enabled: true, respond: accepted}\n"
        "    retry: {attempts: 1}\n"
        f'dlq: {{path: "{tmp_path}/dlq.sqlite3"}}\n'
    )
    body = config(app, tmp_path).replace("routes:\n", "routes:\n" + extra.split("dlq: {path")[0])
    body += extra[extra.index("dlq: {path") :]
    port, _ = await start(proc_stack, tmp_path, body)
    first = await raw_request(port, write(b"d1"))
    assert first.startswith(b"HTTP/1.1 201") and len(fields(first, b"date")) == 1
    again = await raw_request(port, write(b"d1"))
    assert b"Idempotent-Replayed: true" in again
    assert len(fields(again, b"date")) == 1, again
    assert fields(again, b"proxy-status") == [b"retry-sidecar"], again
    app.status = 503
    queued = write(b"q1").replace(b"/orders", b"/queued")
    first = await raw_request(port, queued)
    assert first.startswith(b"HTTP/1.1 202"), first
    assert len(fields(first, b"proxy-status")) == 1
    again = await raw_request(port, queued)
    assert again.startswith(b"HTTP/1.1 202") and b"Idempotent-Replayed: true" in again
    assert fields(again, b"proxy-status") == [b"retry-sidecar"], again
    assert len(fields(again, b"date")) == 1, again


# What someone with write access to the store puts into a kept answer: (field, value).
TAMPERED: list[tuple[str, bytes]] = [
    ("headers", b'[["X-A", "v\\r\\nSet-Cookie: evil=1"]]'),
    ("headers", b'[["X-A", "v\\nSet-Cookie: evil=1"]]'),
    ("headers", b'[["X-A", "v\\u0000evil"]]'),
    ("headers", b'[["Set-Cookie: evil=1\\r\\nX-A", "v"]]'),
    ("headers", b'[["X A", "evil"]]'),
    ("headers", b'[["Transfer-Encoding", "chunked"]]'),
    ("headers", b'[["Content-Length", "0"]]'),
    ("headers", b'[["X-A"]]'),
    ("headers", b'{"X-A": "evil"}'),
    ("headers", b"not json evil"),
    ("status", b"1200"),
    ("status", b"200 OK\r\nSet-Cookie: evil=1"),
]


def refused(raw: bytes) -> None:
    assert raw.startswith(b"HTTP/1.1 503"), raw
    assert b"store-unavailable" in raw and b"evil" not in raw, raw
    assert raw.count(b"HTTP/1.1") == 1, raw  # one response: nothing split


async def test_a_tampered_kept_answer_in_sqlite_is_a_store_error_never_written(
    app: WriteApp, tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    port, _ = await start(proc_stack, tmp_path, config(app, tmp_path))
    db = sqlite3.connect(tmp_path / "keys.sqlite3", isolation_level=None, timeout=5)
    try:
        for n, (column, value) in enumerate(TAMPERED):
            key = b"t%d" % n
            assert (await raw_request(port, write(key))).startswith(b"HTTP/1.1 201")
            stored = value.decode("latin-1") if column == "headers" else value.decode()
            db.execute(
                f"UPDATE idempotency_keys SET {column} = ? WHERE key = ?",
                (stored, stored_key(key.decode(), NO_SCOPE, "orders")),
            )
            refused(await raw_request(port, write(key)))
    finally:
        db.close()
    assert len(app.writes) == len(TAMPERED)  # nothing ran twice


async def test_a_tampered_kept_answer_in_redis_is_a_store_error_never_written(
    app: WriteApp, tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    with running(tmp_path / "redis") as server:
        await _tampered_in_redis(app, tmp_path, proc_stack, server)


async def _tampered_in_redis(
    app: WriteApp, tmp_path: Path, proc_stack: list[SidecarProcess], server: RedisServer
) -> None:
    port, _ = await start(proc_stack, tmp_path, fleet_config(app, server))
    client = Redis.from_url(server.url)
    try:
        for n, (name, value) in enumerate(TAMPERED):
            key = b"t%d" % n
            assert (await raw_request(port, write(key))).startswith(b"HTTP/1.1 201")
            assert await client.hset(b"retry-sidecar:idem:orders/- " + key, name, value) == 0
            refused(await raw_request(port, write(key)))
        # A body field that is not what was kept, a size that is no count: the same.
        assert (await raw_request(port, write(b"s"))).startswith(b"HTTP/1.1 201")
        await client.hset(b"retry-sidecar:idem:orders/- s", "size", "-5")
        await client.hset(b"retry-sidecar:idem:orders/- s", "kept", "0")
        refused(await raw_request(port, write(b"s")))
    finally:
        await client.aclose()
    assert len(app.writes) == len(TAMPERED) + 1

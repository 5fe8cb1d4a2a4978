"""Effectively-once writes across replicas: two real sidecar processes keep their
keys in one real redis-server (``idempotency: {backend: redis}``), in front of one app on
loopback that counts the writes it runs. Duplicates split between the sidecars reach the app
once; a paused Redis gets the route's ``on_store_error``; a Redis killed and restarted mid-traffic
has lost no answer a client was given."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from redis.asyncio import Redis

from tests.garbageredis import garbage_server
from tests.idempotency import test_idempotency_process as process
from tests.idempotency.test_idempotency_process import TIMEOUT, WriteApp, counts, post, problem
from tests.proc import SidecarProcess, start_process
from tests.redisserver import RedisServer, running
from tests.wait import until_async
from tests.webserver import serve

pytestmark = pytest.mark.slow
app = process.app  # the fixtures: the counting app, the sidecars stopped after the test
proc_stack = process.proc_stack


@pytest.fixture
async def redis(tmp_path: Path) -> AsyncIterator[RedisServer]:
    with running(tmp_path / "redis") as server:
        yield server


def fleet_config(app: WriteApp, redis: RedisServer, idem: str = "{enabled: true}") -> str:
    return (
        "idempotency: {backend: redis}\n"
        f'fleet: {{redis: {{url: "{redis.url}", timeout: 500ms}}}}\n'
        "routes:\n"
        "  - name: orders\n"
        f'    upstream: "http://127.0.0.1:{app.port}"\n'
        f"    idempotency: {idem}\n"
    )


async def start_in(stack: list[SidecarProcess], directory: Path, body: str) -> tuple[int, int]:
    directory.mkdir()
    proc, port, admin = await start_process(directory, body)
    stack.append(proc)
    return port, admin


async def test_fifty_duplicates_split_between_two_sidecars_reach_the_app_once(
    app: WriteApp,
    tmp_path: Path,
    proc_stack: list[SidecarProcess],
    redis: RedisServer,
) -> None:
    body = fleet_config(app, redis)
    a, admin_a = await start_in(proc_stack, tmp_path / "a", body)
    b, admin_b = await start_in(proc_stack, tmp_path / "b", body)
    go = asyncio.Event()
    async with aiohttp.ClientSession(timeout=TIMEOUT) as s:

        async def one(port: int) -> tuple[int, bytes]:
            await go.wait()
            url = f"http://127.0.0.1:{port}/orders"
            async with s.post(url, data=b'{"sku": 1}', headers={"Idempotency-Key": "dup"}) as r:
                return r.status, await r.read()

        tasks = [asyncio.create_task(one(a if i % 2 else b)) for i in range(50)]
        go.set()
        results = await asyncio.gather(*tasks)
    assert len(app.writes) == 1
    assert {status for status, _ in results} <= {201, 409}
    firsts = (await counts(admin_a)).get("first", 0) + (await counts(admin_b)).get("first", 0)
    assert firsts == 1
    # Whichever sidecar ran it, both replay the one answer now.
    for port in (a, b):
        status, headers, again = await post(port, key="dup")
        assert (status, json.loads(again), headers["Idempotent-Replayed"]) == (
            201,
            {"write": 1},
            "true",
        )


@pytest.mark.parametrize("on_error", ["refuse", "pass"])
async def test_a_redis_paused_past_its_timeout_gets_on_store_error(
    app: WriteApp,
    tmp_path: Path,
    proc_stack: list[SidecarProcess],
    redis: RedisServer,
    on_error: str,
) -> None:
    port, admin = await start_in(
        proc_stack,
        tmp_path / "a",
        fleet_config(app, redis, f"{{enabled: true, on_store_error: {on_error}}}"),
    )
    assert (await post(port, key="before"))[0] == 201
    redis.pause()
    try:
        status, headers, made = await post(port, key="during")
    finally:
        redis.resume()
    if on_error == "refuse":
        assert status == 503 and headers["Content-Type"] == "application/problem+json"
        problem(made, "store-unavailable")
        assert len(app.writes) == 1
    else:
        assert status == 201 and len(app.writes) == 2
    assert (await counts(admin))["store-error"] == 1


async def test_a_redis_killed_and_restarted_mid_traffic_loses_no_kept_answer(
    app: WriteApp,
    tmp_path: Path,
    proc_stack: list[SidecarProcess],
    redis: RedisServer,
) -> None:
    port, _ = await start_in(proc_stack, tmp_path / "a", fleet_config(app, redis))
    given: dict[str, bytes] = {}  # key -> the answer a client was given (201)
    stop = asyncio.Event()

    async def traffic() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            status, _, body = await post(port, body=b"%d" % i, key=f"k{i}")
            if status == 201:
                given[f"k{i}"] = body

    writer = asyncio.create_task(traffic())
    try:
        while len(given) < 20:
            await asyncio.sleep(0.01)
        # Each of these answers was held until Redis acknowledged its key kept (the guard
        # sends it only then). restart() blocks the loop: nothing is added meanwhile.
        acknowledged = dict(given)
        redis.restart()  # SIGKILL while keys are being claimed and kept, then the same files
        while len(given) < len(acknowledged) + 20:
            await asyncio.sleep(0.01)
    finally:
        stop.set()
        await writer
    for key, body in given.items():
        status, headers, again = await post(port, body=key[1:].encode(), key=key)
        if key in acknowledged:
            assert (status, again, headers.get("Idempotent-Replayed")) == (201, body, "true"), key
        else:
            # Answered while Redis was down: kept, or its completion failed and the key stays
            # claimed until its lease -- never run twice.
            assert status == 409 or (status, again) == (201, body), key
    assert len(app.writes) == len(set(app.writes))  # no write ran twice


@pytest.mark.parametrize("on_error", ["refuse", "pass"])
async def test_after_a_redis_restart_the_next_duplicate_is_replayed_not_a_store_error(
    app: WriteApp,
    tmp_path: Path,
    proc_stack: list[SidecarProcess],
    redis: RedisServer,
    on_error: str,
) -> None:
    """A Redis restarted gracefully (its AOF keeps the key) closes the sidecar's idle pooled
    connections: they are replaced before a command is sent, so the duplicate that comes once
    Redis answers again finds the key, under either ``on_store_error``."""
    port, admin = await start_in(
        proc_stack,
        tmp_path / "a",
        fleet_config(app, redis, f"{{enabled: true, on_store_error: {on_error}}}"),
    )
    for i in range(3):
        assert (await post(port, key=f"k{i}"))[0] == 201
        redis.stop()  # SIGTERM: the connections it had are closed; the files stay
        redis.start()  # answers PING before it returns
        status, headers, again = await post(port, key=f"k{i}")
        assert (status, headers.get("Idempotent-Replayed")) == (201, "true"), again
    assert len(app.writes) == 3
    seen = await counts(admin)
    assert (seen["first"], seen["replayed"], seen["store-error"]) == (3, 3, 0)


async def test_a_first_write_is_two_commands_to_redis_one_claim_one_keep(
    app: WriteApp,
    tmp_path: Path,
    proc_stack: list[SidecarProcess],
    redis: RedisServer,
) -> None:
    """Each command is a round trip the guarded write waits for on a busy loop; the claim was
    four (WATCH, HGETALL, TIME, MULTI/EXEC): its p99 tail under load. Seen from Redis's side
    (MONITOR): between two markers, one guarded first write sends exactly one claim script and
    one keep script, and nothing else (the scripts' own commands run inside Redis)."""
    port, _ = await start_in(proc_stack, tmp_path / "a", fleet_config(app, redis))
    assert (await post(port, key="warm"))[0] == 201  # its connection open, its scripts loaded
    watcher = Redis.from_url(redis.url)
    try:
        async with asyncio.timeout(30), watcher.monitor() as monitor:
            await watcher.echo("marker-begin")
            assert (await post(port, key="measured"))[0] == 201
            await watcher.echo("marker-end")
            while (await monitor.next_command())["command"] != "ECHO marker-begin":
                pass
            sent: list[str] = []
            while (got := await monitor.next_command())["command"] != "ECHO marker-end":
                if got["client_type"] != "lua":
                    sent.append(got["command"].split(" ", 1)[0].upper())
    finally:
        await watcher.aclose()
    assert sent == ["EVALSHA", "EVALSHA"]
    assert len(app.writes) == 2


async def test_a_write_refused_during_a_redis_stall_leaves_no_claim_for_its_retry(
    app: WriteApp,
    tmp_path: Path,
    proc_stack: list[SidecarProcess],
    redis: RedisServer,
) -> None:
    """Issue 29 item 3: a write refused with 503 ``store-unavailable`` while Redis is paused
    (SIGSTOP, 1.5 s): its claim script, already sent, runs when Redis resumes, after the
    sidecar gave up on it. It must not hold the key: the client's retry of a write that never
    ran reaches the app (not 409 with the whole lease as ``Retry-After``)."""
    port, _ = await start_in(proc_stack, tmp_path / "a", fleet_config(app, redis))
    assert (await post(port, key="warm"))[0] == 201  # connection open, scripts loaded
    redis.pause()
    try:
        status, _, made = await post(port, key="stalled")
        assert status == 503
        problem(made, "store-unavailable")
        await asyncio.sleep(1.5 - 0.5)  # the pause: 1.5 s in all (the post took the 500 ms)
    finally:
        redis.resume()
    assert len(app.writes) == 1

    async def retried() -> tuple[int, dict[str, str], bytes]:
        while True:  # the link's pause after the failure, then Redis answers again
            got = await post(port, key="stalled")
            if got[0] != 503:
                return got
            await asyncio.sleep(0.1)

    status, headers, body = await asyncio.wait_for(retried(), 15)
    assert (status, json.loads(body)) == (201, {"write": 2}), headers
    assert len(app.writes) == 2


GARBAGE = {
    "simple-string": b"+OK\r\n",
    "integer": b":1\r\n",
    "short-array": b"*1\r\n:1\r\n",
    "numbers-not-text": b"*2\r\n:1\r\n:1\r\n",
    "nested": b"*3\r\n:0\r\n$3\r\n1.5\r\n:7\r\n",
    "http": b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("on_error", ["refuse", "pass"])
@pytest.mark.parametrize("garbage", list(GARBAGE))
async def test_a_redis_that_answers_garbage_is_a_store_error(
    app: WriteApp,
    tmp_path: Path,
    proc_stack: list[SidecarProcess],
    garbage: str,
    on_error: str,
) -> None:
    """Issue 29 item 4: another server on Redis's port (or a proxy in between) answering
    replies of the wrong shape: every guarded write gets its route's ``on_store_error`` (503
    ``store-unavailable``, or on ``pass`` the app runs it exactly once), never 502 ``internal``
    with a traceback, and ``GET /status`` shows the idempotency link not connected with the
    error."""
    async with garbage_server(GARBAGE[garbage]) as port_of_redis:
        body = (
            "idempotency: {backend: redis}\n"
            f'fleet: {{redis: {{url: "redis://127.0.0.1:{port_of_redis}/0", timeout: 500ms}}}}\n'
            "routes:\n  - name: orders\n"
            f'    upstream: "http://127.0.0.1:{app.port}"\n'
            f"    idempotency: {{enabled: true, on_store_error: {on_error}}}\n"
        )
        directory = tmp_path / "a"
        directory.mkdir()
        proc, port, admin = await start_process(directory, body)
        proc_stack.append(proc)
        status, _, made = await post(port, key="k")
        if on_error == "refuse":
            assert status == 503, (status, made)
            problem(made, "store-unavailable")
            assert app.writes == []
        else:
            assert (status, json.loads(made)) == (201, {"write": 1})
            assert len(app.writes) == 1
        assert (await counts(admin))["store-error"] == 1
        async with (
            aiohttp.ClientSession(timeout=TIMEOUT) as s,
            s.get(f"http://127.0.0.1:{admin}/status") as r,
        ):
            fleet = (await r.json())["process"]["fleet"]["idempotency"]
        assert fleet["state"] != "connected" and fleet["error"], fleet
        await asyncio.sleep(0.3)  # a settlement retried in the background meets the same
        assert len(app.writes) == (1 if on_error == "pass" else 0)
    log = proc.stderr()
    assert "Traceback" not in log and "internal" not in log, log[-3000:]


def fill(server: RedisServer) -> int:
    """Fill the Redis with 1 KiB values until it refuses a write with OOM (noeviction)."""
    import redis as sync_redis

    c = sync_redis.Redis(port=server.port)
    try:
        for n in range(100_000):
            try:
                c.set(f"fill:{n}", b"x" * 1024)
            except sync_redis.exceptions.OutOfMemoryError:
                # Kept past the bound whatever is freed meanwhile (this client's buffers): the
                # limit set 256 KiB below what Redis uses now (noeviction: nothing is evicted).
                used = int(c.info("memory")["used_memory"])
                c.config_set("maxmemory", used - 256 * 1024)
                return n
        raise AssertionError("the Redis never refused a write")
    finally:
        c.close()


@pytest.mark.parametrize("on_error", ["refuse", "pass"])
async def test_a_redis_at_its_maxmemory_refuses_new_keys_by_on_store_error(
    app: WriteApp, tmp_path: Path, proc_stack: list[SidecarProcess], on_error: str
) -> None:
    """Issue 29 item 7: the fleet's Redis is bounded by its ``maxmemory`` with ``noeviction``.
    At the bound it refuses the claim script at its first write (OOM): a new guarded write
    follows on_store_error (503, or forwarded unguarded once), counted ``store-full`` (the
    alert's), nothing of the key written, the link still connected (a full Redis is not an
    unreachable one); a key it holds is still replayed; memory freed, keys are kept again."""
    # Room at start for the sidecar's pooled connections (opened at start: each has buffers in
    # Redis's used memory); fill() then sets the bound just below what Redis uses.
    args = ("--maxmemory", "32mb", "--maxmemory-policy", "noeviction")
    with running(tmp_path / "redis", *args) as server:
        idem = f"{{enabled: true, on_store_error: {on_error}}}"
        port, admin = await start_in(proc_stack, tmp_path / "a", fleet_config(app, server, idem))
        assert (await post(port, key="held"))[0] == 201
        assert fill(server) > 0
        status, headers, made = await post(port, key="new")
        if on_error == "refuse":
            assert status == 503 and headers["Content-Type"] == "application/problem+json"
            problem(made, "store-unavailable")
            assert len(app.writes) == 1
        else:
            assert (status, json.loads(made)) == (201, {"write": 2})
        r = Redis(port=server.port)
        try:
            names = {k.decode() async for k in r.scan_iter("retry-sidecar:*")}
            assert not [n for n in names if n.endswith("new")], names  # nothing half-written
            seen = await counts(admin)
            assert (seen["store-full"], seen.get("store-error", 0)) == (1, 0)
            status, headers, _ = await post(port, key="held")  # a key it holds: replayed
            assert (status, headers.get("Idempotent-Replayed")) == (201, "true")
            url = f"http://127.0.0.1:{admin}/status"
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url) as resp:
                fleet = (await resp.json())["process"]["fleet"]
            assert fleet["idempotency"]["state"] == "connected"
            # Room made: a new key is claimed and kept again.
            await r.flushdb()
            assert (await post(port, key="after"))[0] == 201
            status, headers, _ = await post(port, key="after")
            assert headers.get("Idempotent-Replayed") == "true"
        finally:
            await r.aclose()


async def test_at_its_maxmemory_a_refused_keep_or_renewal_does_not_pause_the_link(
    tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    """Issue 29 F5: a keep and the lease renewals of a write that was claimed before Redis
    filled up meet ``OOM``; they were counted as failures of the link, which paused (the link
    "unreachable", replays of kept keys 503 store-unavailable). An ``OOM`` is Redis answering:
    the link stays connected, a kept key is replayed throughout, the refused keep is counted
    ``store-full`` and tried again in the background (a duplicate meanwhile 409), and lands
    once there is room."""
    gate, entered = asyncio.Event(), asyncio.Event()
    big = b"x" * 200_000

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        if request.path == "/big":
            entered.set()
            await gate.wait()
            return web.Response(body=big, status=201, content_type="text/plain")
        return web.Response(body=b"small", status=201, content_type="text/plain")

    args = ("--maxmemory", "32mb", "--maxmemory-policy", "noeviction")
    with running(tmp_path / "redis", *args) as server:
        async with serve(handle) as app_port:
            body = (
                "idempotency: {backend: redis}\n"
                f'fleet: {{redis: {{url: "{server.url}", timeout: 500ms}}}}\n'
                "routes:\n  - name: orders\n"
                f'    upstream: "http://127.0.0.1:{app_port}"\n'
                "    idempotency: {enabled: true, lease: 300ms}\n"
            )
            port, admin = await start_in(proc_stack, tmp_path / "a", body)
            assert (await post(port, key="held"))[0] == 201
            write = asyncio.create_task(post(port, key="big", path="/big"))
            await asyncio.wait_for(entered.wait(), 10)
            assert fill(server) > 0
            await asyncio.sleep(0.5)  # renewals (every 100 ms) meet OOM meanwhile
            gate.set()
            status, _, got = await write
            assert (status, got) == (201, big)  # the client's answer, whatever the keep met
            url = f"http://127.0.0.1:{admin}/status"
            async with aiohttp.ClientSession(timeout=TIMEOUT) as s, s.get(url) as resp:
                fleet = (await resp.json())["process"]["fleet"]
            assert fleet["idempotency"]["state"] == "connected", fleet
            for _ in range(5):  # a kept key: replayed, never 503
                status, headers, got = await post(port, key="held")
                assert (status, headers.get("Idempotent-Replayed"), got) == (201, "true", b"small")
            assert (await post(port, key="big", path="/big"))[0] == 409  # kept in the background
            seen = await counts(admin)
            assert (seen["store-full"], seen.get("store-error", 0)) == (1, 0), seen
            r = Redis(port=server.port)
            try:
                names = [name async for name in r.scan_iter("fill:*", count=10_000)]
                for at in range(0, len(names), 1000):
                    await r.delete(*names[at : at + 1000])
            finally:
                await r.aclose()

            async def replayed() -> bool:
                status, headers, _ = await post(port, key="big", path="/big")
                return status == 201 and headers.get("Idempotent-Replayed") == "true"

            await until_async(replayed, "the keep to land once there is room")
            log = proc_stack[-1].stderr()
            assert "Traceback" not in log, log[-3000:]

"""A guarded write outlives its client: the real sidecar process (uvloop, as shipped)
in front of a real app that counts the writes it runs. Once a write may have reached the app it
is never given back because the client went: the exchange runs on in the background (nginx's
``proxy_ignore_client_abort on``), and its key is settled by the app's answer -- finished with
it (kept whole, or its status when it is streamed) -- so the client's retry is replayed, or
gets 409 while the first still runs. A stop whose drain runs out leaves the key in progress
until its lease, as a killed sidecar does."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime

import aiohttp
import pytest
from aiohttp import web

from tests.idempotency.test_idempotency_process import (
    call,
    config,
    post,
    start,
)
from tests.idempotency.test_idempotency_process import proc_stack as proc_stack
from tests.wait import until, until_async
from tests.webserver import serve

pytestmark = pytest.mark.slow

BIG = 64 * 1024  # the streamed answer's first part, over the route's max_response_bytes


@dataclass
class GatedApp:
    """Every POST is a write (counted); it is answered once ``gate`` opens: 201 whole, or (for
    ``/big``) a 200 whose head and first ``BIG`` bytes come at once and the rest after the
    gate (too large to keep: relayed as it comes)."""

    port: int = 0
    writes: int = 0
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.writes += 1
        self.entered.set()
        if request.path == "/big":
            resp = web.StreamResponse(status=200, headers={"Content-Type": "text/plain"})
            await resp.prepare(request)
            await resp.write(b"x" * BIG)
            await self.gate.wait()
            await resp.write(b"y" * 16)
            await resp.write_eof()
            return resp
        await self.gate.wait()
        return web.json_response({"write": self.writes}, status=201)


@pytest.fixture
async def app() -> AsyncIterator[GatedApp]:
    ga = GatedApp()
    async with serve(ga.handle) as ga.port:
        yield ga
        ga.gate.set()  # a handler held at the gate ends before the server is cleaned up


async def key_state(admin: int, key: str) -> str | None:
    """The key's state as the admin API shows it: in-progress, finished, or None (absent)."""
    status, _, body = await call("GET", f"http://127.0.0.1:{admin}/idempotency/{key}")
    return None if status == 404 else str(json.loads(body)["state"])


async def lease_end(admin: int, key: str) -> float:
    """When the key's lease ends (wall clock), as the admin API shows it."""
    body = (await call("GET", f"http://127.0.0.1:{admin}/idempotency/{key}"))[2]
    return datetime.fromisoformat(json.loads(body)["expires_at"]).timestamp()


async def client_gone(admin: int, n: int = 1) -> bool:
    text = (await call("GET", f"http://127.0.0.1:{admin}/metrics"))[2].decode()
    return f'retry_sidecar_requests_total{{route="orders",fate="client-gone"}} {n}' in text


async def send_and_leave(port: int, path: str, key: str, wait_for: int) -> None:
    """A raw client: sends a guarded write, reads ``wait_for`` bytes of the answer (0: none),
    then closes its connection."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(
        f"POST {path} HTTP/1.1\r\nHost: x\r\nIdempotency-Key: {key}\r\n"
        "Content-Length: 2\r\n\r\n{}".encode()
    )
    await w.drain()
    if wait_for:
        await r.readexactly(wait_for)
    w.close()


async def test_a_client_leaving_mid_stream_finishes_the_key_with_its_status(
    app, tmp_path, proc_stack
):
    """An answer over max_response_bytes is streamed, not held; the client reads its head and
    part of its body and leaves. The app acted: the key is finished with its status (body not
    kept), and the client's retry is replayed, never run again."""
    port, admin = await start(
        proc_stack, tmp_path, config(app, tmp_path, "{enabled: true, max_response_bytes: 1KiB}")
    )
    await send_and_leave(port, "/big", "big", wait_for=4096)
    await until_async(lambda: client_gone(admin), "the client's leaving counted")
    app.gate.set()  # the rest of the answer comes, for nobody
    await until_async(lambda: _state_is(admin, "big", {"finished", None}), "the key settled")
    assert await key_state(admin, "big") == "finished"
    status, headers, body = await post(port, body=b"{}", key="big", path="/big")
    assert status == 200 and headers["Idempotent-Replayed"] == "true"
    assert json.loads(body)["type"].endswith(":answer-not-kept")
    assert app.writes == 1


async def test_the_lease_is_renewed_while_the_first_request_runs(app, tmp_path, proc_stack):
    """``lease: 1s`` and an app slower than that: no sidecar died, so the lease never runs out
    under the live request; a duplicate past the first lease gets 409, not the app."""
    port, admin = await start(
        proc_stack, tmp_path, config(app, tmp_path, "{enabled: true, lease: 1s}")
    )
    first = asyncio.create_task(post(port, body=b"{}", key="slow"))
    await app.entered.wait()
    claimed = await lease_end(admin, "slow")
    await until_async(lambda: _after(claimed + 0.5), "the first lease to pass")
    assert await key_state(admin, "slow") == "in-progress"
    assert await lease_end(admin, "slow") > claimed  # renewed
    status, headers, _ = await post(port, body=b"{}", key="slow")
    assert status == 409 and int(headers["Retry-After"]) >= 1
    app.gate.set()
    assert (await first)[0] == 201
    assert app.writes == 1


async def test_a_client_that_leaves_before_the_answer_does_not_abandon_its_write(
    app, tmp_path, proc_stack
):
    """The client sends its write and leaves while the app runs it (an impatient client). The
    exchange runs on: while it runs its retry gets 409; once the app answered, the retry gets
    that answer replayed. The app runs the write once."""
    port, admin = await start(proc_stack, tmp_path, config(app, tmp_path))
    _, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(
        b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: gone\r\nContent-Length: 2\r\n\r\n{}"
    )
    await w.drain()
    await app.entered.wait()
    w.close()  # the client leaves while the app runs the write
    await until_async(lambda: client_gone(admin), "the client's leaving counted")
    assert await key_state(admin, "gone") == "in-progress"
    status, headers, _ = await post(port, body=b"{}", key="gone")
    assert status == 409 and int(headers["Retry-After"]) >= 1
    app.gate.set()
    await until_async(lambda: _state_is(admin, "gone", {"finished"}), "the key finished")
    status, headers, body = await post(port, body=b"{}", key="gone")
    assert (status, headers["Idempotent-Replayed"]) == (201, "true")
    assert json.loads(body) == {"write": 1} and app.writes == 1
    assert await client_gone(admin)  # counted once, though its write ended after


async def test_a_stop_whose_drain_runs_out_leaves_the_key_in_progress(app, tmp_path, proc_stack):
    """SIGTERM with a write in flight and a drain shorter than the app: the write is cut, but
    it reached the app, so its key is not given back: after the restart its retry gets 409
    (until the lease passes), exactly as after a SIGKILL, and the app runs the write once."""
    body = config(app, tmp_path, extra="drain_timeout: 200ms\n")
    port, _ = await start(proc_stack, tmp_path, body)
    first = asyncio.create_task(post(port, body=b"{}", key="term"))
    await app.entered.wait()
    stopping = proc_stack.pop()
    assert await asyncio.to_thread(stopping.terminate) == 0  # SIGTERM, until it exited
    with pytest.raises(aiohttp.ClientError):
        await first
    app.gate.set()  # the app finished the write; its answer had nobody to reach
    port, admin = await start(proc_stack, tmp_path, body)
    assert await key_state(admin, "term") == "in-progress"
    status, headers, _ = await post(port, body=b"{}", key="term")
    assert status == 409 and int(headers["Retry-After"]) >= 1
    assert app.writes == 1


async def test_a_stop_lets_a_write_whose_client_left_end_within_the_drain(
    app, tmp_path, proc_stack
):
    """A write whose client left counts in the drain like any request in flight: SIGTERM comes
    while it runs, the app answers within the drain, and its key is finished with that answer:
    after the restart the client's retry is replayed."""
    body = config(app, tmp_path, extra="drain_timeout: 20s\n")
    port, admin = await start(proc_stack, tmp_path, body)
    _, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(
        b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: left\r\nContent-Length: 2\r\n\r\n{}"
    )
    await w.drain()
    await app.entered.wait()
    w.close()
    await until_async(lambda: client_gone(admin), "the client's leaving counted")
    stopping = proc_stack.pop()
    assert stopping.proc is not None
    stopping.proc.send_signal(signal.SIGTERM)
    await until(lambda: "draining" in stopping.stderr(), "the drain to start")
    app.gate.set()
    assert await asyncio.to_thread(stopping.proc.wait, 30) == 0
    port, _ = await start(proc_stack, tmp_path, body)
    status, headers, answer = await post(port, body=b"{}", key="left")
    assert (status, headers["Idempotent-Replayed"]) == (201, "true")
    assert json.loads(answer) == {"write": 1} and app.writes == 1


async def _state_is(admin: int, key: str, states: set[str | None]) -> bool:
    return await key_state(admin, key) in states


async def _after(wall: float) -> bool:
    return time.time() > wall

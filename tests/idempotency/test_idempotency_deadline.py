"""One deadline per request: a guarded write whose client leaves runs on bounded by the same
deadline as its sequence (counted from the end of its body), never by one counted from its
arrival. The real sidecar process in front of a real app that counts the writes it runs per key,
clients on raw sockets that trickle their body and leave."""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.idempotency.test_idempotency_detached import key_state
from tests.idempotency.test_idempotency_process import config, post, start
from tests.idempotency.test_idempotency_process import proc_stack as proc_stack
from tests.wait import until_async
from tests.webserver import serve

pytestmark = pytest.mark.slow

UPLOAD = 1.5  # seconds the client takes to send its body, over the route's deadline's start
APP = 1.0  # seconds the app takes to answer, once it has the body
TIMEOUT = "2s"  # the route's timeout: shorter than upload + app, longer than app
BODY = b'{"order": 1, "pad": "' + b"x" * 100 + b'"}'
PIECES = 10


@dataclass
class SlowApp:
    """Every POST is a write, counted per key; answered 201 ``APP`` seconds after its body."""

    port: int = 0
    writes: Counter[str] = field(default_factory=Counter)
    answered: Counter[str] = field(default_factory=Counter)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        key = request.headers.get("Idempotency-Key", "")
        self.writes[key] += 1
        await asyncio.sleep(APP)
        self.answered[key] += 1
        return web.json_response({"key": key, "write": self.writes[key]}, status=201)


@pytest.fixture
async def app() -> AsyncIterator[SlowApp]:
    sa = SlowApp()
    async with serve(sa.handle) as sa.port:
        yield sa


def route_config(app: SlowApp, tmp_path: object) -> str:
    return config(app, tmp_path, extra=f"    timeout: {TIMEOUT}\n")  # type: ignore[arg-type]


# The request line's version and the connection fields: HTTP/1.1 kept alive, HTTP/1.0, close.
VARIANTS = {
    "http/1.1": ("HTTP/1.1", ""),
    "http/1.0": ("HTTP/1.0", ""),
    "connection-close": ("HTTP/1.1", "Connection: close\r\n"),
}


async def trickle_and_leave(
    port: int, key: str, leave_after: float | None, rng: random.Random, variant: str = "http/1.1"
) -> None:
    """A guarded write whose head comes at once and whose body takes ``UPLOAD`` seconds, each
    split at random byte boundaries (the body in ``PIECES`` pieces); the client closes its
    connection ``leave_after`` seconds after it began (None: right after its body)."""
    loop = asyncio.get_running_loop()
    began = loop.time()
    version, fields = VARIANTS[variant]
    head = (
        f"POST /orders {version}\r\nHost: x\r\nIdempotency-Key: {key}\r\n{fields}"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode()
    _, w = await asyncio.open_connection("127.0.0.1", port)
    for piece in _split(head, 3, rng):
        w.write(piece)
        await w.drain()

    async def send() -> None:
        for piece in _split(BODY, PIECES, rng):
            await asyncio.sleep(UPLOAD / PIECES)
            w.write(piece)
            await w.drain()

    try:
        if leave_after is None:
            await send()
        else:
            sending = asyncio.ensure_future(send())
            await asyncio.wait({sending}, timeout=max(0.0, began + leave_after - loop.time()))
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)
            await asyncio.sleep(max(0.0, began + leave_after - loop.time()))
    finally:
        w.close()


def _split(data: bytes, n: int, rng: random.Random) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), n - 1))
    return [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]


async def _settled(admin: int, keys: list[str]) -> bool:
    return all([await key_state(admin, k) != "in-progress" for k in keys])


@pytest.mark.parametrize("variant", list(VARIANTS))
async def test_a_write_whose_client_left_after_a_slow_upload_runs_once(
    app, tmp_path, proc_stack, variant
):
    """The body takes 1.5 s, the client leaves once it is sent, the app answers 1 s later:
    2.5 s after the request arrived, within the 2 s deadline counted from the end of the body.
    The write runs on to the app's answer and its key is finished: the client's retry gets the
    answer replayed, and the app ran the write once. (Bounded from the arrival, the write was
    cut before the app answered, its key left in progress: the retry got 409, and after the
    lease ran the write again.)"""
    port, admin = await start(proc_stack, tmp_path, route_config(app, tmp_path))
    await trickle_and_leave(port, "slow-upload", None, random.Random(variant), variant)
    await until_async(lambda: _answered(app, "slow-upload"), "the app to answer", timeout=10)
    await until_async(lambda: _settled(admin, ["slow-upload"]), "the key settled", timeout=10)
    assert await key_state(admin, "slow-upload") == "finished"
    status, headers, body = await post(port, body=BODY, key="slow-upload")
    assert (status, headers.get("Idempotent-Replayed")) == (201, "true")
    assert json.loads(body) == {"key": "slow-upload", "write": 1}
    assert app.writes["slow-upload"] == 1


async def test_a_client_gone_at_random_points_leaves_no_key_stuck(app, tmp_path, proc_stack):
    """Clients leave at random points of the upload and of the exchange after it. Each key is
    then settled (finished: its retry replayed) or released (absent: its body never came
    whole, or the write was given back), never left in progress; no write runs twice."""
    port, admin = await start(proc_stack, tmp_path, route_config(app, tmp_path))
    rng = random.Random(29)
    cuts = {f"cut-{i}": rng.uniform(0.0, UPLOAD + APP + 0.3) for i in range(8)}
    await asyncio.gather(*(trickle_and_leave(port, k, at, rng) for k, at in cuts.items()))
    keys = list(cuts)
    # Every write that reached the app ends within 1 s of its body; then no key may be held.
    await until_async(lambda: _all_answered(app), "the app to answer every write", timeout=10)
    await until_async(lambda: _settled(admin, keys), "every key settled", timeout=10)
    for key in keys:
        state = await key_state(admin, key)
        ran = app.writes[key]
        assert state in ("finished", None), (key, cuts[key], state)
        status, headers, body = await post(port, body=BODY, key=key)
        assert status == 201, (key, cuts[key], status, body)
        if state == "finished":
            assert headers.get("Idempotent-Replayed") == "true" and ran == 1
        assert app.writes[key] == 1, (key, cuts[key], app.writes[key])


async def _answered(app: SlowApp, key: str) -> bool:
    return app.answered[key] >= 1


async def _all_answered(app: SlowApp) -> bool:
    return all(app.answered[k] >= n for k, n in app.writes.items())

"""An upstream that answers a streamed upload early (413, 401 before reading the body) and
closes, or closes mid-upload without a word: the early answer is relayed as nginx does, the
close is an ``upstream-reset``, never an ``internal`` fault. Under uvloop (the real process,
as shipped) a write to the closed upstream transport raises; under asyncio's loop it is
dropped silently: both loops are run."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from tests.conftest import routes_yaml
from tests.proc import start_process
from tests.rawhttp import raw_server, read_head

BODY = b"u" * (1024 * 1024)  # far over max_body_bytes: streamed
TRIES = 20


async def refuse_and_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_head(r)
    w.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\nConnection: close\r\n\r\nnope")
    await w.drain()  # and the connection closes, the body unread


async def refuse_and_linger(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """As nginx and gunicorn close after an early answer: the answer, then the body read away
    until the client stops sending, so no reset can overtake the answer."""
    await read_head(r)
    w.write(b"HTTP/1.1 413 Payload Too Large\r\nContent-Length: 4\r\nConnection: close\r\n\r\nnope")
    await w.drain()
    w.write_eof()
    with contextlib.suppress(ConnectionError):
        while await r.read(65536):
            pass


async def close_mid_upload(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_head(r)
    await r.readexactly(100_000)  # part of the body, then gone without an answer


async def upload(port: int, expect: bool) -> tuple[bytes, bytes]:
    """PUT a streamed body, reading the answer while it is sent: (head, body) of the answer."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    head = (
        b"PUT /up HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n" % len(BODY)
        + (b"Expect: 100-continue\r\n" if expect else b"")
        + b"\r\n"
    )

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            w.write(head)
            for i in range(0, len(BODY), 65536):
                w.write(BODY[i : i + 65536])
                await w.drain()

    sender = asyncio.create_task(send())
    try:
        async with asyncio.timeout(20):
            while True:
                got = await r.readuntil(b"\r\n\r\n")
                if not got.startswith(b"HTTP/1.1 100"):
                    break
            m = re.search(rb"(?i)content-length: (\d+)", got)
            body = await r.readexactly(int(m.group(1))) if m else b""
    finally:
        sender.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sender
        w.close()
    return got, body


Runner = Callable[[int], Awaitable[int]]


@pytest.fixture(params=["uvloop-process", "asyncio-in-process"])
async def sidecar_port(
    request: pytest.FixtureRequest, tmp_path: Path, sidecar_factory
) -> AsyncIterator[Runner]:
    """Starts a sidecar in front of an upstream port: the real process (uvloop) or one in
    this test's asyncio loop; yields the function that does it."""
    procs = []

    async def start(upstream: int) -> int:
        route = "    retry: {max_body_bytes: 16, attempts: 3}\n    breaker: {enabled: false}\n"
        if request.param == "uvloop-process":
            body = (
                "limits: {max_request_body: 4MiB}\nroutes:\n  - name: main\n"
                f'    upstream: "http://127.0.0.1:{upstream}"\n{route}'
            )
            proc, port, _ = await start_process(tmp_path, body)
            procs.append(proc)
            return port
        sc = await sidecar_factory(
            routes_yaml(f"http://127.0.0.1:{upstream}", route, "limits: {max_request_body: 4MiB}")
        )
        return int(sc.sidecar.proxy_port)

    yield start
    for p in procs:
        p.terminate()


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100"])
async def test_an_early_answer_is_relayed(sidecar_port: Runner, expect: bool):
    """An upstream that answers early and then reads the body away (lingering close, as nginx
    and gunicorn do): its answer is relayed, every time."""
    async with raw_server(refuse_and_linger) as upstream:
        port = await sidecar_port(upstream)
        for _ in range(TRIES):
            head, body = await upload(port, expect)
            assert head.startswith(b"HTTP/1.1 413"), head
            assert body == b"nope"
            assert b"x-retry-fate: not-retryable" in head


@pytest.mark.parametrize("expect", [False, True], ids=["plain", "expect-100"])
async def test_an_early_answer_that_closes_is_relayed_or_a_reset(
    sidecar_port: Runner, expect: bool
):
    """An upstream that answers early and closes at once, the body unread: its kernel resets
    the connection, and a reset that overtakes the answer destroys it before the sidecar can
    read it (nginx, in the sidecar's place, answers 502 then too). Each try is the answer
    relayed or an ``upstream-reset`` -- never an ``internal`` fault -- and the answer is
    relayed whenever it won the race."""
    relayed = 0
    async with raw_server(refuse_and_close) as upstream:
        port = await sidecar_port(upstream)
        for _ in range(TRIES):
            head, body = await upload(port, expect)
            if head.startswith(b"HTTP/1.1 413"):
                assert body == b"nope"
                assert b"x-retry-fate: not-retryable" in head
                relayed += 1
            else:
                assert head.startswith(b"HTTP/1.1 502"), head
                assert b"x-retry-proxy-error: upstream-reset" in head, head
    assert relayed > 0


async def test_an_upstream_that_closes_mid_upload_is_a_reset(sidecar_port: Runner):
    async with raw_server(close_mid_upload) as upstream:
        port = await sidecar_port(upstream)
        for _ in range(TRIES):
            head, _ = await upload(port, False)
            assert head.startswith(b"HTTP/1.1 502"), head
            assert b"x-retry-proxy-error: upstream-reset" in head, head

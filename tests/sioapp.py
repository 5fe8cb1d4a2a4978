"""A Socket.IO app on aiohttp reached over HTTP long-polling only (python-socketio's client
with ``transports=["polling"]``: what a client behind a proxy that refuses WebSocket falls back
to): the client sends echoes it waits an acknowledgement for, one after the other, then asks
for ticks, which the server pushes 0.2 s apart. Every GET poll is held until the server has
something to send (far longer than the echoes' round trips a latency estimate learnt from), and Engine.IO refuses a second GET
poll of a session while one is open, so a proxy that duplicates a poll breaks the session."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import socketio
from aiohttp import web

from tests.threeways import Tally
from tests.wait import until

ECHOES = 40
TICKS = 10
TICK_EVERY = 0.2  # each GET poll is held this long: far longer than an echo's round trip


@dataclass
class Counts:
    """What the app ran: its event handlers, and the HTTP requests it answered by status."""

    events: Counter[str] = field(default_factory=Counter)
    statuses: Counter[int] = field(default_factory=Counter)


@asynccontextmanager
async def server() -> AsyncIterator[tuple[int, Counts]]:
    counts = Counts()
    # Pings every second (25 s by default): a held poll is answered within a second, so the
    # session (and a disconnect, which waits for the poll in flight) moves on at that pace.
    sio = socketio.AsyncServer(async_mode="aiohttp", ping_interval=1, ping_timeout=2)
    tickers: set[asyncio.Task[None]] = set()

    @web.middleware
    async def count(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        response = await handler(request)
        counts.statuses[response.status] += 1
        return response

    async def ticker(sid: str) -> None:
        for i in range(TICKS):
            await sio.emit("tick", i, to=sid)
            counts.events["tick"] += 1
            await asyncio.sleep(TICK_EVERY)

    async def connect(sid: str, environ: object) -> None:
        counts.events["connect"] += 1

    async def start(sid: str) -> None:
        counts.events["start"] += 1
        task = asyncio.create_task(ticker(sid))
        tickers.add(task)
        task.add_done_callback(tickers.discard)

    async def echo(sid: str, data: object) -> object:
        counts.events["echo"] += 1
        return data

    sio.on("connect", connect)
    sio.on("start", start)
    sio.on("echo", echo)
    app = web.Application(middlewares=[count])
    sio.attach(app)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield int(runner.addresses[0][1]), counts
    finally:
        for task in list(tickers):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await runner.cleanup()


async def run(base: str, counts: Counts) -> Tally:
    """Connect over polling, send ECHOES echoes one after the other, then ask for the ticks
    and wait for every one."""
    client = socketio.AsyncClient(reconnection=False)
    ticks: list[int] = []
    echoes: list[object] = []
    failed: list[str] = []

    async def on_tick(i: int) -> None:
        ticks.append(i)

    client.on("tick", on_tick)
    refusals: dict[int, int] = {}
    t0 = time.monotonic()
    try:
        await client.connect(base, transports=["polling"], wait_timeout=10)
    except socketio.exceptions.ConnectionError as exc:
        failed.append(f"connect: {exc}")
    else:
        try:
            for i in range(ECHOES):
                try:
                    echoes.append(await client.call("echo", i, timeout=10))
                except socketio.exceptions.SocketIOError as exc:
                    failed.append(f"echo {i}: {type(exc).__name__}")
            await client.emit("start")
            # Bounded: the ticker sends TICKS and stops; a broken session ends the wait too.
            with contextlib.suppress(AssertionError):
                await until(lambda: len(ticks) >= TICKS or not client.connected, "every tick")
            if len(ticks) < TICKS:
                failed.append(f"ticks: {len(ticks)} of {TICKS} (connected: {client.connected})")
        finally:
            # Before the disconnect: the poll it leaves open is answered 400 once the session
            # has closed, direct as through any proxy.
            refusals = {s: n for s, n in counts.statuses.items() if s >= 400}
            await client.disconnect()
    seconds = time.monotonic() - t0
    outcome: dict[str, object] = {
        "ticks": ticks,
        "echoes": echoes,
        "failed": failed,
        "app refusals": refusals,
    }
    answered = len(echoes) + (0 if any(f.startswith("connect") for f in failed) else 1)
    return Tally(
        outcome=outcome,
        answered=answered,
        refused=len(failed),
        handled={k: n for k, n in counts.events.items() if k != "tick"},
        seconds=seconds,
    )

"""Raw-socket helpers for tests that need exact bytes on the wire."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

RawHandler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def raw_server(handler: RawHandler) -> AsyncIterator[int]:
    """A TCP server on loopback running ``handler`` per connection; yields its port."""
    tasks: set[asyncio.Task[None]] = set()

    async def on_conn(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await handler(r, w)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()
            tasks.discard(task)

    server = await asyncio.start_server(on_conn, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield port
    finally:
        server.close()
        for t in list(tasks):
            t.cancel()
        await server.wait_closed()


async def read_head(r: asyncio.StreamReader) -> bytes:
    return await r.readuntil(b"\r\n\r\n")


def canned(response: bytes, close: bool = True) -> RawHandler:
    """Answer every request on the connection with ``response`` (then close if asked)."""

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        while True:
            await read_head(r)
            w.write(response)
            await w.drain()
            if close:
                return

    return h


async def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send bytes, read until the peer closes (or timeout); return what came back."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(data)
    await w.drain()
    out = b""
    try:
        async with asyncio.timeout(timeout):
            while True:
                chunk = await r.read(65536)
                if not chunk:
                    break
                out += chunk
    except (TimeoutError, ConnectionError):
        pass
    w.close()
    return out

"""An in-repo fault proxy for tests (there is no toxiproxy here): TCP servers that misbehave in
one precise way per connection, so each upstream fault can be checked on its own."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Awaitable, Callable

Fault = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]

OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"


def _rst(w: asyncio.StreamWriter) -> None:
    """Close with a TCP RST (SO_LINGER 0) instead of a FIN."""
    sock = w.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    w.transport.abort()


async def read_request(r: asyncio.StreamReader) -> bytes:
    return await r.readuntil(b"\r\n\r\n")


async def ok(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while True:
        await read_request(r)
        w.write(OK)
        await w.drain()


async def serve_ok(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """``ok`` as an ``asyncio.start_server`` callback: the client leaving (or the server
    closing) ends it quietly, not as an unhandled exception in the callback."""
    with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
        await ok(r, w)


async def reset_before_request(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    _rst(w)


async def reset_after_request(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    _rst(w)


async def reset_mid_body(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b"x" * 5000)
    await w.drain()
    await asyncio.sleep(0.05)
    _rst(w)


async def head_never_finishes(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n")
    await w.drain()
    await asyncio.sleep(30)


async def slow_drip(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """The head arrives at once, then one body byte every 0.5 s."""
    await read_request(r)
    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
    await w.drain()
    for _ in range(100):
        await asyncio.sleep(0.5)
        w.write(b"d")
        await w.drain()


async def half_close(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    """Reads the request, then shuts its sending side without a word."""
    await read_request(r)
    w.write_eof()
    await asyncio.sleep(1)


async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    await read_request(r)
    w.write(b"SSH-2.0-OpenSSH_9.2\r\n\r\n")
    await w.drain()
    await asyncio.sleep(1)


def per_connection(*faults: Fault) -> Fault:
    """Connection n gets faults[n] (the last one repeats)."""
    count = [0]

    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        i = min(count[0], len(faults) - 1)
        count[0] += 1
        await faults[i](r, w)

    return h

"""A server on a port where the fleet's Redis should be that answers garbage: RESP of the wrong
shape to every command (``reply``), or not RESP at all, as another server on Redis's port or a
proxy in between would. It reads each command whole (RESP arrays of bulk strings, as redis-py
sends them) and answers it once; ``CLIENT`` commands (the connection's handshake) get ``+OK``,
so the garbage reaches the commands that matter. Runs on the test's loop, on loopback."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


async def _command(reader: asyncio.StreamReader) -> list[bytes]:
    head = await reader.readline()
    if not head.startswith(b"*"):
        raise ConnectionError(f"not a RESP command: {head!r}")
    parts = []
    for _ in range(int(head[1:])):
        size = int((await reader.readline())[1:])
        parts.append((await reader.readexactly(size + 2))[:-2])
    return parts


@contextlib.asynccontextmanager
async def garbage_server(reply: bytes) -> AsyncIterator[int]:
    """Serve on a free loopback port (yielded) until the block is left."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                command = await _command(reader)
                writer.write(b"+OK\r\n" if command[0].upper() == b"CLIENT" else reply)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ValueError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()

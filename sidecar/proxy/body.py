"""Reading a client's request body: buffered up to a limit (so it can be resent), streamed
once beyond it, every read bounded by the body idle timeout.

Interpreted on purpose (not in the compiled build): ``BodyStream`` is an async iterator handed to
the upstream side, and only uploads too large to buffer take this path.
"""

from __future__ import annotations

import asyncio

from aiohttp import ClientPayloadError, web
from aiohttp.http_exceptions import HttpProcessingError

READ_CHUNK = 64 * 1024


class BodyTooLarge(Exception):
    pass


class BodyStalled(Exception):
    pass


class BodyMalformed(Exception):
    """The request body broke its framing (a chunk size that is not hex): a 400."""


class ClientGone(Exception):
    """The client's connection broke while its request body was read (an aborted upload).
    Not an upstream failure: it must never count as one."""


async def _read(request: web.BaseRequest, n: int, idle: float) -> bytes:
    """One read of the client's body, bounded by the body idle timeout."""
    try:
        async with asyncio.timeout(idle):
            return await request.content.read(n)
    except TimeoutError:
        raise BodyStalled(f"the request body stalled for {idle:g}s") from None
    except HttpProcessingError as exc:  # set on the body by the server (proxy/server.py)
        raise BodyMalformed(f"the request body is malformed: {exc.message}") from None
    except (ConnectionError, ClientPayloadError) as exc:
        raise ClientGone(f"the client left during its upload: {exc}") from None


async def read_prefix(request: web.BaseRequest, limit: int, idle: float) -> tuple[bytes, bool]:
    """Read up to limit+1 bytes: (bytes read, whether the body ended within the limit)."""
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await _read(request, limit + 1 - len(buf), idle)
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf), False


class BodyStream:
    """The rest of a body too large to buffer, read from the client as the upstream takes it.

    A plain async iterator (not an async generator): an attempt that stops consuming it
    half-way leaves no generator to finalise, and it compiles with mypyc."""

    __slots__ = ("_idle", "_max_total", "_prefix", "_request", "_total", "started")

    def __init__(
        self, request: web.BaseRequest, prefix: bytes, max_total: int, idle: float
    ) -> None:
        self._request = request
        self._prefix: bytes | None = prefix
        self._total = len(prefix)
        self._max_total = max_total
        self._idle = idle
        self.started = False  # whether any byte was handed to the upstream side

    def __aiter__(self) -> BodyStream:
        return self

    async def __anext__(self) -> bytes:
        self.started = True
        if self._prefix is not None:
            prefix, self._prefix = self._prefix, None
            return prefix
        chunk = await _read(self._request, READ_CHUNK, self._idle)
        if not chunk:
            raise StopAsyncIteration
        self._total += len(chunk)
        if self._total > self._max_total:
            raise BodyTooLarge(f"request body over {self._max_total} bytes")
        return chunk

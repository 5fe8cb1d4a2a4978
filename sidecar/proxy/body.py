"""Reading a client's request body: buffered up to a limit (so it can be resent), streamed
once beyond it, every read bounded by the body idle timeout.

The front end gives the body as a ``frontend.RequestBody`` (``h1.H1Body`` maps aiohttp's
errors to ``BodyMalformed`` and ``ClientGone``); nothing here names a protocol.

Interpreted on purpose (not in the compiled build): ``BodyStream`` is an async iterator handed to
the upstream side, and only uploads too large to buffer take this path.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sidecar.proxy.frontend import RequestBody

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


async def _read(body: RequestBody, n: int, idle: float) -> bytes:
    """One read of the client's body, bounded by the body idle timeout."""
    try:
        async with asyncio.timeout(idle):
            return await body.read(n)
    except TimeoutError:
        raise BodyStalled(f"the request body stalled for {idle:g}s") from None


async def read_prefix(body: RequestBody, limit: int, idle: float) -> tuple[bytes, bool]:
    """Read up to limit+1 bytes: (bytes read, whether the body ended within the limit)."""
    buf = bytearray()
    while len(buf) <= limit:
        chunk = await _read(body, limit + 1 - len(buf), idle)
        if not chunk:
            return bytes(buf), True
        buf += chunk
    return bytes(buf), False


class ReplayBody:
    """A request stream sent as it arrives and kept for a retry while it fits (a gRPC call's
    messages: a bidirectional call must not wait for the client's end before the upstream
    sees its first message). ``stream`` gives each attempt the body from its start: what is
    kept, then reads from the client (one reader at a time; what one reads, all see). Past
    ``limit`` nothing more is kept and it is no longer ``replayable`` (gRFC A6: the call is
    committed); a stale reader then ends with an error, never a truncated body."""

    __slots__ = (
        "_base",
        "_body",
        "_idle",
        "_kept",
        "_limit",
        "_lock",
        "_max_total",
        "ended",
        "size",
    )

    def __init__(self, body: RequestBody, limit: int, max_total: int, idle: float) -> None:
        self._body = body
        self._limit = limit
        self._max_total = max_total
        self._idle = idle
        self._kept: list[bytes] = []
        self._base = 0  # chunks dropped from the front of ``_kept`` once over the limit
        self._lock = asyncio.Lock()
        self.size = 0
        self.ended = False

    @property
    def replayable(self) -> bool:
        return self._base == 0 and self.size <= self._limit

    def stream(self) -> ReplayStream:
        return ReplayStream(self)

    def chunk(self, i: int) -> bytes | None:
        """Chunk ``i`` when it was read already; raises when it was dropped."""
        if i < self._base:
            raise BodyTooLarge("the request stream outgrew the retry buffer")
        j = i - self._base
        return self._kept[j] if j < len(self._kept) else None

    async def more(self, i: int) -> None:
        """Read the client's next chunk (unless another reader did meanwhile)."""
        async with self._lock:
            if self.ended or i < self._base + len(self._kept):
                return
            chunk = await _read(self._body, READ_CHUNK, self._idle)
            if not chunk:
                self.ended = True
                return
            self.size += len(chunk)
            if self.size > self._max_total:
                raise BodyTooLarge(f"request body over {self._max_total} bytes")
            if self.size > self._limit and len(self._kept) > 0:
                # Committed: only the newest chunk is still wanted (by its reader).
                self._base += len(self._kept)
                self._kept.clear()
            self._kept.append(chunk)


class ReplayStream:
    """One attempt's reading of a ``ReplayBody`` (an async iterator, as ``BodyStream``)."""

    __slots__ = ("_i", "_src")

    def __init__(self, src: ReplayBody) -> None:
        self._src = src
        self._i = 0

    def __aiter__(self) -> ReplayStream:
        return self

    async def __anext__(self) -> bytes:
        src = self._src
        while True:
            chunk = src.chunk(self._i)
            if chunk is not None:
                self._i += 1
                return chunk
            if src.ended:
                raise StopAsyncIteration
            await src.more(self._i)


class BodyStream:
    """The rest of a body too large to buffer, read from the client as the upstream takes it.

    A plain async iterator (not an async generator): an attempt that stops consuming it
    half-way leaves no generator to finalise, and it compiles with mypyc."""

    __slots__ = ("_body", "_idle", "_max_total", "_prefix", "_total", "started")

    def __init__(self, body: RequestBody, prefix: bytes, max_total: int, idle: float) -> None:
        self._body = body
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
        chunk = await _read(self._body, READ_CHUNK, self._idle)
        if not chunk:
            raise StopAsyncIteration
        self._total += len(chunk)
        if self._total > self._max_total:
            raise BodyTooLarge(f"request body over {self._max_total} bytes")
        return chunk

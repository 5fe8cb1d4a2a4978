"""Sending a streamed request body upstream while watching for an early answer.

Kept out of the mypyc-compiled modules (see setup.py): it awaits inside a ``finally`` block, whose
exception unwinding mypyc gets wrong.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from sidecar.core import UpstreamReset
from sidecar.upstream.connection import Connection


async def send_stream(
    conn: Connection, body: AsyncIterator[bytes], chunked: bool, idle: float
) -> bool:
    """Send the body; False when the upstream answered before it was all sent (the rest of
    the body is then left unread, as nginx and Envoy do with an early response).

    Each read of the client's body races the upstream's answer, so that an upload refused
    early (413, 401) is answered at once instead of when the client finishes sending."""
    it = body.__aiter__()
    # The two pending futures live in lists, not in Optional locals: mypyc narrows a local
    # assigned None in the loop and then misreads it in the ``finally`` block.
    answer: list[asyncio.Future[None]] = []
    reading: list[asyncio.Future[bytes]] = []
    try:
        while True:
            if conn.has_answer():
                return False
            if conn.error is not None or conn.closed:
                raise conn.error or UpstreamReset("upstream closed while the body was sent")
            nxt = asyncio.ensure_future(it.__anext__())
            reading.append(nxt)
            if not answer:
                answer.append(asyncio.ensure_future(conn.wait_answer()))
            await asyncio.wait((nxt, answer[0]), return_when=asyncio.FIRST_COMPLETED)
            if not nxt.done():  # answered (or broke) before the client's next bytes came
                if conn.has_answer():
                    return False
                raise conn.error or UpstreamReset("upstream closed while the body was sent")
            reading.clear()
            ended = False  # (no break inside try/finally: mypyc compiles this module)
            try:
                chunk = nxt.result()
            except StopAsyncIteration:
                ended, chunk = True, b""
            if ended:
                break
            if not chunk:
                continue
            # The upstream may have answered (or closed) while the client's bytes were read:
            # a write to its closed transport raises under uvloop ("the handler is closed")
            # and is dropped under asyncio. An answer is relayed; a close is a reset. One
            # loop turn first lets an answer already in the socket be read: an upstream that
            # answered and then closed unread sends a reset, and a write that meets it closes
            # the transport with the answer still unread.
            await asyncio.sleep(0)
            if conn.has_answer():
                return False
            if conn.error is not None or conn.closed:
                raise conn.error or UpstreamReset("upstream closed while the body was sent")
            if chunked:
                conn.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
            else:
                conn.write(chunk)
            await conn.drain(idle)
    finally:
        for r in reading:
            r.cancel()  # a no-op when done
        for a in answer:
            a.cancel()
        if reading:
            # The client's body read is stopped; let it unwind before the caller goes on.
            await asyncio.gather(*reading, return_exceptions=True)
    if conn.has_answer():
        return False
    if chunked:
        conn.write(b"0\r\n\r\n")
    return True

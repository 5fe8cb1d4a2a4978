"""A real aiohttp app on a free loopback port for tests: the HTTP sibling of
``tests.rawhttp.raw_server``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def serve(handler: Handler) -> AsyncIterator[int]:
    """``handler`` answers every method and path, on loopback; yields the port. The server is
    cleaned up on every exit: a handler still running is cancelled after 0.2 s."""
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield int(runner.addresses[0][1])
    finally:
        await runner.cleanup()

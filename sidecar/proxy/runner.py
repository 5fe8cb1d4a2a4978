"""The proxy listener's runner: aiohttp's, drained for the drain time in force when the drain
starts, and the check that aiohttp's C request parser is the one in use."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web

from sidecar.proxy.server import SidecarServer


class DrainingRunner(web.ServerRunner):
    """aiohttp's runner, with the drain time read when the drain starts rather than when the
    runner was built, so that a reloaded ``drain_timeout`` applies to the next shutdown."""

    def __init__(self, server: SidecarServer, drain_timeout: Callable[[], float]) -> None:
        super().__init__(server, handle_signals=False, shutdown_timeout=drain_timeout())
        self._drain_timeout = drain_timeout

    async def cleanup(self) -> None:
        # aiohttp keeps the value in BaseRunner._shutdown_timeout (its only setting for it)
        # and reads it in cleanup(); there is no public setter.
        drain = self._shutdown_timeout = self._drain_timeout()
        server = self.server
        cut = (
            asyncio.get_running_loop().call_later(drain, server.cut)
            if isinstance(server, SidecarServer)
            else None
        )
        try:
            await super().cleanup()
        finally:
            if cut is not None:
                cut.cancel()


def c_parser_in_use() -> bool:
    """aiohttp's C HTTP parser rejects request-smuggling shapes its Python fallback has let by."""
    from aiohttp import http_parser

    return http_parser.HttpRequestParser.__module__ == "aiohttp._http_parser"

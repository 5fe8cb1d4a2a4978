"""The admin listener's server: the admin application served by the same guarded aiohttp
server as the proxy listener (``proxy/server.SidecarServer``), so a client of the admin port
meets the proxy's limits: a request head must be complete within ``limits.header_timeout``
(408; a connection's first head from accept, so one that never sends a byte is closed), a
connection idle between requests is closed after ``limits.keepalive_timeout``, a
client that takes no response bytes is cut after ``limits.send_timeout``, and a malformed
request gets a 400 or 431 without a traceback in the log. aiohttp's own server has none of
the first three (its keep-alive default is an hour).

``web.AppRunner`` builds aiohttp's plain server in ``_make_server``; this runner lets it (so
the application is started and frozen the usual way) and serves the same handler and request
factory from a ``SidecarServer`` instead. That method is aiohttp-internal, pinned by the
version range in pyproject.toml and covered by tests/admin/test_admin_guard.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aiohttp import web

from sidecar.admin.server import SECURITY_HEADERS
from sidecar.proxy.respond import SidecarResponse
from sidecar.proxy.server import GuardedRequestHandler, SidecarServer


def refusal(status: int, message: str) -> web.Response:
    """The listener's own refusals (400, 408, 431: no handler ran, so no ``on_response_prepare``
    either): the admin's JSON error with ``SECURITY_HEADERS``, no ``Server`` banner."""
    return SidecarResponse(
        status=status,
        body=json.dumps({"error": message}).encode(),
        headers={"Content-Type": "application/json", **SECURITY_HEADERS},
    )


class AdminRunner(web.AppRunner):
    def __init__(
        self,
        app: web.Application,
        header_timeout: Callable[[], float],
        send_timeout: Callable[[], float],
        keepalive_timeout: float,
        **kwargs: Any,
    ) -> None:
        super().__init__(app, **kwargs)
        self._header_timeout = header_timeout
        self._send_timeout = send_timeout
        self._keepalive_timeout = keepalive_timeout

    async def _make_server(self) -> web.Server:
        plain = await super()._make_server()  # starts and freezes the application
        app_handler = plain.request_handler

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            try:
                return await app_handler(request)
            finally:
                # The next bytes on this connection start a new head, with its own deadline.
                if isinstance(request.protocol, GuardedRequestHandler):
                    request.protocol.request_done()

        return SidecarServer(
            handle,
            header_timeout=self._header_timeout,
            send_timeout=self._send_timeout,
            on_malformed=lambda reason: None,  # malformed_requests_total counts the proxy's
            refuse=refusal,
            request_factory=plain.request_factory,
            keepalive_timeout=self._keepalive_timeout,
            access_log=None,
        )

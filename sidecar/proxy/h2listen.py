"""The proxy listener speaking both HTTP/1.1 and HTTP/2 on one port.

Each accepted connection starts with a ``Sniffer``, which hands the transport over to the
protocol that speaks what the client speaks (``transport.set_protocol``, then the new protocol's
``connection_made`` and the bytes read so far), and is never seen again:

- over TLS, by ALPN (known before the first byte: uvloop makes the protocol once the handshake
  is done): ``h2`` goes to the HTTP/2 front end (``proxy/h2conn.py``), anything else to aiohttp's
  HTTP/1.1 connection handler (``GuardedRequestHandler``);
- in plaintext, by the first bytes: HTTP/2 with prior knowledge (h2c) starts with the client's
  connection preface ``PRI * HTTP/2.0\\r\\n\\r\\nSM\\r\\n\\r\\n``; the first byte that differs
  from it decides HTTP/1.1 (for "POST" or "PUT", the second). A client that sends no byte, or
  only a beginning of the preface, within ``limits.header_timeout`` is closed without an answer,
  as the HTTP/1.1 handler closes one that sent nothing.

An HTTP/1.1 request costs nothing more once its connection is handed over. ``Upgrade: h2c`` is
never acted on (the HTTP/1.1 handler drops it as hop-by-hop).
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

from sidecar.proxy.h2conn import H2Server
from sidecar.proxy.h2fields import PREFACE
from sidecar.proxy.h2limits import limits_of
from sidecar.proxy.handler import ProxyHandler
from sidecar.proxy.server import SidecarServer


class Sniffer(asyncio.Protocol):
    """A new connection until it is known which protocol it speaks (see the module
    docstring)."""

    def __init__(self, server: DualServer) -> None:
        self._server = server
        self._transport: asyncio.Transport | None = None
        self._buf = b""
        self._timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport = cast(asyncio.Transport, transport)  # uvloop's: no subclass
        tls = transport.get_extra_info("ssl_object")
        if tls is not None:
            h2 = tls.selected_alpn_protocol() == "h2"
            self._hand(self._server.h2() if h2 else self._server.h1(), b"")
            return
        self._timer = asyncio.get_running_loop().call_later(
            self._server.header_timeout(), self._timed_out
        )

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data
        if len(buf) < len(PREFACE) and PREFACE.startswith(buf):
            self._buf = buf  # a beginning of the preface: not decided yet
            return
        self._buf = b""
        if buf.startswith(PREFACE):
            self._hand(self._server.h2(), buf)
        else:
            self._hand(self._server.h1(), buf)

    def _hand(self, protocol: asyncio.Protocol, data: bytes) -> None:
        self._cancel()
        transport = self._transport
        assert transport is not None
        self._transport = None
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if data and not transport.is_closing():
            protocol.data_received(data)

    def eof_received(self) -> bool | None:
        self._close()
        return None

    def _timed_out(self) -> None:
        self._timer = None
        self._close()

    def _close(self) -> None:
        self._cancel()
        if self._transport is not None:
            self._transport.close()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self._transport = None


class DualServer(SidecarServer):
    """The proxy's ``SidecarServer``, each connection first sniffed (``Sniffer``); its HTTP/2
    connections drained and cut with the HTTP/1.1 ones (``proxy/runner.py``)."""

    def __init__(self, handler: ProxyHandler, **kwargs: Any) -> None:
        super().__init__(handler, **kwargs)
        self._serve = handler.serve
        self._store = handler.deps.store  # an HTTP/2 connection's limits: the config in force
        self.h2_connections: set[H2Server] = set()
        self._draining = False

    def __call__(self) -> Any:
        return Sniffer(self)

    def h1(self) -> asyncio.Protocol:
        return SidecarServer.__call__(self)

    def h2(self) -> H2Server:
        conn = H2Server(
            self._serve,
            limits_of(self._store.current),
            count=self.count,
            lost=self.h2_connections.discard,
        )
        self.h2_connections.add(conn)
        if self._draining:  # accepted just before the listener stopped
            asyncio.get_running_loop().call_soon(conn.drain)
        return conn

    def pre_shutdown(self) -> None:
        self._draining = True
        super().pre_shutdown()
        for conn in list(self.h2_connections):
            conn.drain()

    async def shutdown(self, timeout: float | None = None) -> None:
        waits = [conn.wait_closed(timeout) for conn in list(self.h2_connections)]
        await asyncio.gather(super().shutdown(timeout), *waits)

    def cut(self) -> None:
        super().cut()
        for conn in list(self.h2_connections):
            conn.cut_all()

"""HTTP Upgrade (WebSocket and any other protocol) passed through as a tunnel.

A request that asks for an upgrade (HTTP/1.1, ``Connection: upgrade`` and ``Upgrade``) on a
route with ``upgrade.enabled`` goes upstream with those two headers (hop-by-hop, dropped from
every other request) through the ordinary sequence, which retries only a connect failure (no
byte sent) and never hedges. If the upstream answers 101, the answer is relayed and the two
connections are joined: bytes both ways, as they come, until both sides have closed (a side
that half-closes, a FIN, is passed on as a FIN and the other way keeps flowing), either side
resets, nothing moves either way for ``upgrade.idle_timeout``, or the handler is cancelled (the
client's connection lost, or the drain after SIGTERM running out). Any other answer is relayed
as a normal response by the handler.

What a tunnel holds is given back on every exit, in a ``finally``: the upstream connection
(closed; it left the pool at the 101), the client connection (closed, never reused), the idle
timer, its count in the in-flight gauge; and, through the sequence scope it runs in, the
route's bulkhead slot. Flow control both ways: a side whose peer's write buffer is above
HIGH_WATER stops being read until that buffer drains.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from sidecar.config.model import Route
from sidecar.engine.answered import Answered, client_gone
from sidecar.proxy import forward
from sidecar.proxy.frontend import ClientRequest, Head
from sidecar.proxy.h1 import H1Sink
from sidecar.proxy.server import GuardedRequestHandler
from sidecar.upstream.client import UpstreamResponse

HIGH_WATER = 256 * 1024

# How a tunnel ended (the ``result`` label of upgrades_total), and the answers that opened none.
CLOSED = "closed"  # both sides closed, or one side closed after the other's FIN
IDLE_TIMEOUT = "idle-timeout"
RESET = "reset"  # a side's connection broke (or closed while the other still sent)
CUT = "cut"  # the handler was cancelled: the client's connection lost, or the drain ran out
REFUSED = "refused"  # the upstream answered the upgrade request with something else than 101
FAILED = "failed"  # no upstream answer (the sidecar answered: 502, 503, 504)
RESULTS = (CLOSED, IDLE_TIMEOUT, RESET, CUT, REFUSED, FAILED)


class Tunnels:
    """Open tunnels by route (read by the in-flight gauge at scrape time) and the count of
    upgrade requests by route and result (``ended``, the metrics adapter)."""

    def __init__(self, ended: Callable[[str, str], None] = lambda route, result: None) -> None:
        self.open: dict[str, int] = {}
        self.ended = ended

    def started(self, route: str) -> None:
        self.open[route] = self.open.get(route, 0) + 1

    def finished(self, route: str, result: str) -> None:
        self.open[route] -= 1
        self.ended(route, result)


def upgrade_wanted(request: ClientRequest, route: Route) -> bytes | None:
    """The ``Upgrade`` value of a request that asks for a tunnel on ``route``, else None.
    HTTP/1.0 upgrades are ignored (RFC 9110 section 7.8), as are those with a body: the
    body framing and the switch would share one connection; and any that offers ``h2c``."""
    if not route.upgrade.enabled or request.version != (1, 1) or request.has_body:
        return None
    value = request.fields.get("Upgrade")
    if not value or not value.strip() or asks_h2c(value):
        return None
    named = forward.connection_named(
        (b"connection", v.encode("latin-1")) for v in request.fields.getall("Connection", ())
    )
    if b"upgrade" not in named:
        return None
    return value.encode("latin-1")


def asks_h2c(value: str) -> bool:
    """Whether an ``Upgrade`` value offers ``h2c`` (HTTP/2 over cleartext, RFC 7540 section
    3.2). Never tunnelled: after a 101 the client's HTTP/2 frames would reach the upstream
    past the routing rules. The request is answered as HTTP/1.1 without its Upgrade (its
    ``HTTP2-Settings`` is hop-by-hop, ``forward.HOP_BY_HOP``), as nginx does."""
    return any(token.split("/", 1)[0].strip().lower() == "h2c" for token in value.split(","))


def upgrade_headers(value: bytes) -> list[tuple[bytes, bytes]]:
    """What an upgrade request carries upstream beyond the filtered headers."""
    return [(b"Upgrade", value), (b"Connection", b"upgrade")]


class _Upstream(asyncio.Protocol):
    """The upstream side of a tunnel, once it has left the pool."""

    def __init__(self, tunnel: Tunnel, tls: bool = False) -> None:
        self.t = tunnel
        self.tls = tls  # over TLS a half-close does not exist (asyncio warns if asked for one)

    def data_received(self, data: bytes) -> None:
        self.t.to_client(data)

    def eof_received(self) -> bool:
        self.t.upstream_eof()
        return not self.tls  # keep the upstream open for what the client still sends

    def connection_lost(self, exc: Exception | None) -> None:
        self.t.upstream_lost(exc)

    def pause_writing(self) -> None:
        pass  # the client side looks at the write buffer itself

    def resume_writing(self) -> None:
        self.t.upstream_drained()


class Tunnel:
    """One joined pair of connections (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        client: asyncio.Transport,
        upstream: asyncio.Transport | None,
        idle_timeout: float,
    ) -> None:
        self._loop = loop
        self._client = client
        self._up = upstream
        self._idle = idle_timeout
        self._last = loop.time()
        self._timer: asyncio.TimerHandle | None = None
        self._client_eof = False
        self._up_eof = upstream is None
        self.done: asyncio.Future[str] = loop.create_future()

    def _end(self, result: str) -> None:
        if not self.done.done():
            self.done.set_result(result)

    def _touch(self) -> None:
        self._last = self._loop.time()

    def start(self) -> None:
        if self._up is None:
            self._end(CLOSED)  # the upstream closed right after its 101
            return
        tls = self._up.get_extra_info("sslcontext") is not None
        self._up.set_protocol(_Upstream(self, tls))
        self._timer = self._loop.call_later(self._idle, self._check_idle)

    def _check_idle(self) -> None:
        left = self._last + self._idle - self._loop.time()
        if left > 0:
            self._timer = self._loop.call_later(left, self._check_idle)
        else:
            self._timer = None
            self._end(IDLE_TIMEOUT)

    # -- upstream -> client -----------------------------------------------------------------

    def to_client(self, data: bytes) -> None:
        self._touch()
        client = self._client
        if client.is_closing():
            self._end(RESET)
            return
        client.write(data)
        if client.get_write_buffer_size() > HIGH_WATER and self._up is not None:
            self._up.pause_reading()  # resumed by client_drained

    def client_drained(self) -> None:
        if self._up is not None and not self._up.is_closing():
            self._up.resume_reading()

    def upstream_eof(self) -> None:
        self._up_eof = True
        if self._client_eof:
            self._end(CLOSED)
        elif self._client.can_write_eof():
            self._client.write_eof()

    def upstream_lost(self, exc: Exception | None) -> None:
        self._end(CLOSED if exc is None and (self._up_eof or self._client_eof) else RESET)

    # -- client -> upstream (aiohttp's payload parser interface) ------------------------------

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        self._touch()
        up = self._up
        if up is None or up.is_closing():
            self._end(RESET)
            return False, b""
        up.write(data)
        if up.get_write_buffer_size() > HIGH_WATER:
            self._client.pause_reading()  # resumed by upstream_drained
        return False, b""

    def upstream_drained(self) -> None:
        if not self._client.is_closing():
            self._client.resume_reading()

    def feed_eof(self) -> None:
        """The client's connection is gone (aiohttp calls this from connection_lost)."""
        self._end(CLOSED if self._client_eof or self._up_eof else RESET)

    def client_eof(self) -> None:
        """The client half-closed: pass the FIN on, keep relaying the upstream's bytes."""
        self._client_eof = True
        if self._up_eof:
            self._end(CLOSED)
        elif self._up is not None and self._up.can_write_eof():
            self._up.write_eof()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._up is not None:
            self._up.close()
        self._client.close()


def switched(up: UpstreamResponse | None) -> bool:
    """Whether the upstream's answer to an upgrade request is its 101."""
    return up is not None and up.status == 101


def not_opened(tunnels: Tunnels, route: Route, up: UpstreamResponse | None) -> None:
    """An upgrade request answered otherwise (relayed as a normal response) or not at all."""
    tunnels.ended(route.name, FAILED if up is None else REFUSED)


async def relay(
    sink: H1Sink,
    route: Route,
    up: UpstreamResponse,
    value: bytes,
    own: list[tuple[bytes, bytes]],
    tunnels: Tunnels,
    *,
    opened: Callable[[Answered], object],
    fate: str,
    attempts: int,
) -> Answered:
    """Relay the upstream's 101 and join the connections until the tunnel ends. ``opened``
    is called once the 101 is out (the request is counted then, not at the tunnel's end)."""
    request = sink.request
    proto = request.protocol
    client = request.transport
    upstream, tail = up.detach()
    headers = forward.response_headers(up.headers)
    head = Head(101, headers + upgrade_headers(value), own, None)
    resp = Answered(101, tuple(headers), fate, attempts, from_upstream=True, endpoint=up.endpoint)
    tunnels.started(route.name)
    result = CUT
    tunnel: Tunnel | None = None
    try:
        if client is None or client.is_closing() or not isinstance(proto, GuardedRequestHandler):
            result = RESET
            return client_gone()
        await sink.start(head)
        sink.hand_over()  # the client connection is the tunnel's: never reused after it
        opened(resp)
        tunnel = Tunnel(asyncio.get_running_loop(), client, upstream, route.upgrade.idle_timeout)
        if tail:
            tunnel.to_client(tail)
        proto.tunnel = tunnel
        proto.set_parser(tunnel)  # type: ignore[arg-type]  # the payload parser interface
        tunnel.start()
        try:
            result = await tunnel.done
        except asyncio.CancelledError:
            # The client's connection was lost (aiohttp cancels its handler) or the drain
            # ran out: the tunnel is over, its accounting below.
            result = CUT if not tunnel.done.done() else tunnel.done.result()
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
        return resp
    finally:
        if tunnel is not None:
            tunnel.close()
        elif upstream is not None:
            upstream.close()
        if isinstance(proto, GuardedRequestHandler):
            proto.tunnel = None
        tunnels.finished(route.name, result)

"""A guarded write's answer, held until its key is settled.

On a route that guards a write (``idempotency``), the relay (``proxy/relay.py``) does not send an
upstream answer whose body fits ``max_response_bytes``: it reads it whole and hands it here, so
``proxy/guarded.py`` can keep it in the store first and send it after (a duplicate that arrives
once the client has its answer then finds it kept, never in progress). A larger answer is relayed
as it comes (its first ``max_response_bytes`` + 1 bytes read ahead) and only its status is kept.
"""

from __future__ import annotations

from sidecar.core import Fate
from sidecar.dlq.capture import Captured
from sidecar.proxy.respond import ProxyResponse, RawHeaders
from sidecar.upstream.client import UpstreamResponse


class HeldAnswer:
    """What the relay did with a guarded write's answer (see the module docstring)."""

    __slots__ = (
        "attempts",
        "body",
        "broken",
        "captured",
        "fate",
        "headers",
        "limit",
        "made_by_sidecar",
        "resp",
        "status",
        "streamed",
    )

    def __init__(self, limit: int) -> None:
        self.limit = limit  # max_response_bytes: larger bodies are relayed, not held
        self.resp: ProxyResponse | None = None  # held, not sent yet
        # The app's answer status once its head came (the app acted), else None.
        self.status: int | None = None
        self.headers: RawHeaders = []  # the upstream's end-to-end headers
        self.body = b""
        self.fate: Fate | str = Fate.SUCCESS
        self.attempts = 0
        self.captured: Captured | None = None  # what the DLQ did with it, on a DLQ route
        self.streamed = False  # relayed as it came (too large to hold)
        self.broken = False  # the upstream broke mid-body: nothing whole to keep or send
        self.made_by_sidecar = False  # an inner sidecar's own answer (x-retry-proxy-error)

    def hold(
        self, resp: ProxyResponse, headers: RawHeaders, body: bytes, *, fate: Fate, attempts: int
    ) -> None:
        self.resp = resp
        self.headers = headers
        self.body = body
        self.fate = fate
        self.attempts = attempts

    async def read(self, up: UpstreamResponse, idle: float) -> tuple[bytes, bool]:
        """Read ahead up to ``limit`` + 1 body bytes: (the bytes, whether the body ended)."""
        buf = bytearray()
        while len(buf) <= self.limit:
            chunk = await up.read_chunk(idle)
            if not chunk:
                return bytes(buf), True
            buf += chunk
        return bytes(buf), False

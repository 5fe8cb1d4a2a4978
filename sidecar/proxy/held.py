"""A guarded write's answer, held until its key is settled: a ``ResponseSink`` in front of the
front end's.

On a route that guards a write (``idempotency``), the answer does not go to the client at once:
an answer whose body fits ``max_response_bytes`` (or is whole in memory already) is held here,
so ``proxy/guarded.py`` can keep it in the store first and send it after (``release``: a
duplicate that arrives once the client has its answer then finds it kept, never in progress). A
larger answer is relayed as it comes (once its first ``max_response_bytes`` + 1 bytes came) and
only its status is kept. Interim answers and a cut go through at once.

``head`` is the answer's head once it came: once the upstream's came, the app acted, whatever
ends the sequence after (``answered``: what the guard settles the key by when ``forward`` ends
without a result).
"""

from __future__ import annotations

import sys

from sidecar.engine.answered import Answered
from sidecar.proxy.frontend import Head, RawHeaders, ResponseSink


class HeldSink:
    """See the module docstring."""

    __slots__ = ("_buf", "_inner", "_streaming", "body", "head", "limit")

    def __init__(self, inner: ResponseSink, limit: int) -> None:
        self._inner = inner
        self.limit = limit  # max_response_bytes: larger bodies are relayed, not held
        self.head: Head | None = None  # the answer's head once it came
        self.body: bytes | None = None  # held whole, not sent yet
        self._buf = bytearray()
        self._streaming = False  # relayed as it comes (too large to hold)

    @property
    def whole_limit(self) -> int:
        return sys.maxsize  # a body already whole in memory is held whatever its size

    @property
    def sent(self) -> int:
        return self._inner.sent

    def gone(self) -> bool:
        return self._inner.gone()

    async def interim(self, status: int, fields: RawHeaders) -> None:
        await self._inner.interim(status, fields)

    def whole(self, head: Head, body: bytes) -> None:
        self.head = head
        self.body = body

    async def start(self, head: Head) -> None:
        self.head = head

    async def write(self, chunk: bytes) -> None:
        if self._streaming:
            await self._inner.write(chunk)
            return
        buf = self._buf
        buf += chunk
        if len(buf) > self.limit:  # too large to hold: relayed from here on
            assert self.head is not None
            self._streaming = True
            ahead = bytes(buf)
            buf.clear()
            await self._inner.start(self.head)
            await self._inner.write(ahead)

    async def end(self, trailers: RawHeaders | None = None) -> None:
        if self._streaming:
            await self._inner.end(trailers)
        else:
            self.body = bytes(self._buf)
            self._buf.clear()

    def abort(self) -> None:
        # Broken before anything went out, or mid-body: the client's connection is cut, as for
        # any answer broken mid-body; nothing is held.
        self.body = None
        self._buf.clear()
        self._inner.abort()

    def answered(self) -> Answered | None:
        """The answer as far as it came (its head; its body not kept), else None."""
        head = self.head
        if head is None or not head.from_upstream:
            return None
        fields = tuple(head.fields) + tuple(
            (k, v) for k, v in head.own if k.lower() in (b"x-retry-dlq", b"x-retry-dlq-id")
        )
        dlq_id = next((v for k, v in head.own if k.lower() == b"x-retry-dlq-id"), None)
        return Answered(
            head.status,
            fields,
            "",
            0,
            from_upstream=True,
            upstream_error=head.upstream_error,
            dlq_id=dlq_id.decode("latin-1") if dlq_id is not None else None,
        )

    def release(self, answered: Answered) -> Answered:
        """Send the held answer, if one is held: what the client got."""
        head, body = self.head, self.body
        if head is None or body is None:
            return answered  # relayed already, or cut
        self.body = None
        self._inner.whole(head, body)
        return answered.with_sent(self._inner.sent)

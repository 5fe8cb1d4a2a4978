"""How one sequence sends an attempt: its head, body and deadline, bound once per sequence.

``AttemptSender.send`` is what ``RouteAttempter`` calls for each attempt (and each hedge). It
adds the per-attempt headers (attempt number, the time left, a traceparent when tracing) to the
head built once for the sequence, and hands the request to the upstream client.

It is a class and not a pair of nested functions on purpose: under mypyc, nested functions
share one environment object that holds the functions themselves, a reference cycle. Every
request then left four objects for the cyclic garbage collector (measured with
``gc.DEBUG_SAVEALL``: ``_start_Sequence_env``, both closures and the ``Deadline``) instead of
freeing them when the sequence ended. Bound methods hold the instance; the instance holds none
of them, so the whole set is freed by reference counting.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from sidecar import outcomes
from sidecar.core import Clock, UpstreamError
from sidecar.retry.deadline import Deadline
from sidecar.retry.endpoints import Endpoint
from sidecar.telemetry.tracing import Tracing
from sidecar.upstream.client import Body, Replay, UpstreamClient, UpstreamResponse
from sidecar.upstream.tls import RouteContext, TlsTarget

if TYPE_CHECKING:
    from opentelemetry.trace import Span


class GrpcCall:
    """What a gRPC call carries into its sequence: the client's own
    ``grpc-previous-rpc-attempts`` (passed on by the first attempt), and whether the client set
    a deadline (``grpc-timeout``): only then does each attempt carry the time left as its own
    ``grpc-timeout``. Without one the upstream gets none, and the route's ``timeout`` bounds the
    wait for the answer's head only, as for any request: a long server stream is not cut."""

    __slots__ = ("previous", "timed")

    def __init__(self, previous: bytes | None, timed: bool) -> None:
        self.previous = previous
        self.timed = timed


class AttemptSender:
    __slots__ = (
        "_body",
        "_chunked",
        "_client",
        "_clock",
        "_deadline",
        "_grpc",
        "_head_base",
        "_head_only",
        "_method",
        "_protocol",
        "_replay",
        "_span",
        "_target",
        "_tls",
        "_tls_hosts",
        "_tracing",
        "_upgrade",
    )

    def __init__(
        self,
        client: UpstreamClient,
        clock: Clock,
        tracing: Tracing,
        span: Span | None,
        method: str,
        head_base: bytes,
        *,
        body: Body,
        chunked: bool,
        deadline: Deadline,
        upgrade: bool = False,
        target: str = "",
        tls: RouteContext | None = None,
        tls_hosts: dict[str, str] | None = None,
        protocol: str = "http1",
        grpc: GrpcCall | None = None,
        replay: Replay | None = None,
    ) -> None:
        self._client = client
        self._clock = clock
        self._tracing = tracing
        self._span = span
        self._method = method
        self._head_base = head_base  # request line and headers, without the per-attempt ones
        self._head_only = method == "HEAD"
        self._body = body
        self._chunked = chunked
        self._deadline = deadline
        self._upgrade = upgrade  # the request asks for a protocol switch (a tunnel)
        self._target = target  # for the attempt's span (url.full)
        # The route's TLS context, and the URL host of its https:// endpoints by name.
        self._tls = tls
        self._tls_hosts = tls_hosts
        self._protocol = protocol  # the route's upstream_protocol
        self._grpc = grpc  # a gRPC call: grpc-timeout and grpc-previous-rpc-attempts per attempt
        self._replay = replay  # a request stream kept for a retry: each attempt reads it anew

    def time_left(self) -> float:
        """Called once a streamed body has been sent: the deadline starts from there."""
        clock, deadline = self._clock, self._deadline
        deadline.restart(clock.monotonic())
        return deadline.remaining(clock.monotonic())

    async def send(
        self, attempt: int, timeout: float, endpoint: Endpoint, hedge: bool
    ) -> UpstreamResponse:
        remaining = self._deadline.remaining_ms(self._clock.monotonic())
        head = self._head_base + b"x-retry-attempt: %d\r\nx-request-timeout-ms: %d\r\n" % (
            attempt,
            remaining,
        )
        body = self._body
        grpc = self._grpc
        if grpc is not None:
            # The time left as the call's own deadline (gRPC's "m": milliseconds, at most 8
            # digits), and how many attempts came before this one (gRFC A6).
            if grpc.timed:
                head += b"grpc-timeout: %dm\r\n" % min(max(remaining, 1), 99_999_999)
            if attempt > 1:
                head += b"grpc-previous-rpc-attempts: %d\r\n" % (attempt - 1)
            elif grpc.previous is not None:
                head += b"grpc-previous-rpc-attempts: " + grpc.previous + b"\r\n"
            if self._replay is not None:
                body = self._replay.stream()
        tls: TlsTarget | None = None
        if self._tls is not None and self._tls_hosts:
            host = self._tls_hosts.get(endpoint.name)
            if host is not None:
                tls = self._tls.target(host)
        span = self._span
        attempt_span: Span | None = None
        if span is not None:
            tracing = self._tracing
            attempt_span = tracing.start_attempt(
                span,
                self._method,
                attempt,
                (endpoint.name, endpoint.host, endpoint.port),
                hedge,
                target=self._target,
                tls=tls is not None,
            )
            head += tracing.inject(attempt_span)
        try:
            up = await self._client.request(
                endpoint.host,
                endpoint.port,
                head + b"\r\n",
                body,
                timeout,
                self._head_only,
                chunked=self._chunked,
                time_left=self.time_left,
                upgrade=self._upgrade,
                tls=tls,
                protocol=self._protocol,
                grpc=grpc is not None,
            )
        except BaseException as exc:
            if attempt_span is not None:
                code = (
                    exc.answer.name  # the outcome's name, as attempts_total{outcome} has it
                    if isinstance(exc, UpstreamError)
                    else outcomes.CANCELLED.name  # a hedge that lost, the client gone
                    if isinstance(exc, asyncio.CancelledError)
                    else type(exc).__name__
                )
                self._tracing.end_attempt(attempt_span, None, code)
            raise
        if attempt_span is not None:
            self._tracing.end_attempt(attempt_span, up.status, None)
        return up

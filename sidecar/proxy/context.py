"""One proxied request as every step of it sees it: the front end's request (``ClientRequest``)
and the sink its answer goes out through (``ResponseSink``), its route and config snapshot, when
it started, its span, the headers that go upstream; and how it ends (``end``: counted once, its
span ended, from the one ``Answered`` that says what the client got).

``admission.admit`` makes it once the request passed the guards; body intake, the sequence
run, the DLQ hand-off and the answer relay each take it instead of a dozen loose arguments.
Each returns the request's ``Answered``; the handler ends the request with it, in one place
(and a tunnel at its 101: ``proxy/tunnel.py``).
Its fields are set once, when it is made (``headers`` is one list that body intake extends
with the framing headers before the first attempt; nothing replaces it).

``deadline`` is the request's one deadline, made here once (the route's ``timeout``, or a smaller
trusted ``x-request-timeout-ms``) and read by everything that bounds the request: the sequence
(its attempts, backoffs, bulkhead wait), and a guarded write that runs on without its client
(``proxy/detached.py``). It counts from the end of the request's body, as Envoy's route timeout
does: body intake restarts it once a buffered body is whole, the sender once a streamed one is
sent (``Deadline.restart``), so a slow upload does not spend the upstream's time.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sidecar.config.model import Config, Route
from sidecar.engine.answered import Answered
from sidecar.engine.sender import GrpcCall
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.frontend import ClientRequest, ResponseSink
from sidecar.proxy.grpccall import GrpcSink
from sidecar.retry.deadline import Deadline, parse_timeout_ms
from sidecar.telemetry.events import SequenceEnded
from sidecar.telemetry.logs import TRACE, RateLimit

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("sidecar.proxy")


class RequestContext:
    """See the module docstring."""

    __slots__ = (
        "as_received",
        "config",
        "deadline",
        "deps",
        "edge",
        "ended",
        "expects_continue",
        "grpc",
        "grpc_call",
        "headers",
        "request",
        "route",
        "sink",
        "span",
        "start",
        "target",
        "timeout_ms",
        "upgrade",
        "upstream",
        "warnings",
    )

    # An explicit __init__ (no @dataclass): mypyc compiles it; one is made per request.
    def __init__(
        self,
        request: ClientRequest,
        sink: ResponseSink,
        deps: ProxyDeps,
        config: Config,
        route: Route,
        *,
        target: str,
        headers: list[tuple[bytes, bytes]],
        as_received: list[tuple[bytes, bytes]],
        edge: bytes | None,
        timeout_ms: bytes | None,
        upgrade: bytes | None,
        expects_continue: bool,
        span: Span | None,
        start: float,
        warnings: RateLimit,
        grpc: GrpcSink | None = None,
        grpc_call: GrpcCall | None = None,
    ) -> None:
        self.request = request
        self.sink = sink  # where the answer goes (a guarded write's: held, proxy/held.py)
        self.deps = deps
        self.config = config  # one snapshot for the whole sequence
        self.route = route
        self.target = target  # origin-form, as request_target read it
        self.headers = headers  # filtered; body intake appends the framing
        self.as_received = as_received  # what a DLQ record keeps (before framing)
        self.edge = edge  # a trusted incoming edge marker
        self.timeout_ms = timeout_ms  # a trusted x-request-timeout-ms
        self.upgrade = upgrade  # the Upgrade value of a tunnel asked for, else None
        self.expects_continue = expects_continue  # Expect: 100-continue, to be answered
        self.span = span
        self.start = start  # monotonic, when the request was admitted
        self.deadline = Deadline.start(
            start,
            route.timeout,
            parse_timeout_ms(timeout_ms.decode("latin-1") if timeout_ms is not None else None),
        )
        self.warnings = warnings  # the handler's rate limit for upstream warnings
        # A gRPC call: its sink (which makes the sidecar's answers gRPC ones and notes the
        # final status), and the client's grpc-previous-rpc-attempts.
        self.grpc = grpc
        self.grpc_call = grpc_call
        # Counted once: a tunnel is counted at its 101, before its handler returns.
        self.ended = False

    @property
    def method(self) -> str:
        return self.request.method

    def end(self, answered: Answered) -> None:
        """The request ends with ``answered``: its span ended, ``SequenceEnded`` to the sinks."""
        if self.ended:
            return
        self.ended = True
        deps = self.deps
        trace_id: str | None = None
        if self.span is not None:
            deps.tracing.end_server(
                self.span,
                answered.status,
                answered.fate,
                answered.attempts,
                answered.proxy_error,
            )
            ids = TRACE.get()
            trace_id = ids[0] if ids is not None else None
        deps.events.sequence_ended(
            SequenceEnded(
                self.route.name,
                self.request.method,
                answered.fate,
                answered.attempts,
                deps.clock.monotonic() - self.start,
                answered.status,
                proxy_error=answered.proxy_error,
                target=self.target,
                upstream=answered.endpoint,
                sent=answered.sent,
                trace_id=trace_id,
                grpc=self.grpc.code_name(answered.fate) if self.grpc is not None else None,
            )
        )

    def upstream_warning(self, message: str) -> None:
        """A warning about the route's upstream, logged at a bounded rate, as nginx does."""
        limit = self.warnings
        if limit.allow():
            suppressed = limit.suppressed
            more = f" ({suppressed} similar suppressed)" if suppressed else ""
            log.warning("route %s: %s%s", self.route.name, message, more)

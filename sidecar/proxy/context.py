"""One proxied request as every step of it sees it: the request, its route and config snapshot,
who sent it, when it started, its span, the headers that go upstream; and how it ends (counted
once, its span ended).

``admission.admit`` makes it once the request passed the guards; body intake, the sequence
run, the DLQ hand-off and the answer relay each take it instead of a dozen loose arguments.
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

from aiohttp import web

from sidecar.config.model import Config, Route
from sidecar.core import Fate
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.held import HeldAnswer
from sidecar.retry.deadline import Deadline, parse_timeout_ms
from sidecar.telemetry.events import SequenceEnded
from sidecar.telemetry.logs import TRACE, RateLimit

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("sidecar.proxy")

# nginx's status for "client closed the request", in metrics, logs and the span.
CLIENT_CLOSED = 499


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
        "headers",
        "held",
        "request",
        "route",
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
        request: web.BaseRequest,
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
    ) -> None:
        self.request = request
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
        # A guarded write's answer, held until its key is settled (proxy/guarded.py); None:
        # relayed at once, as every other answer.
        self.held: HeldAnswer | None = None
        # Counted once: a guarded write whose client left runs on and may end after its
        # handler counted it client-gone (proxy/detached.py).
        self.ended = False
        self.upstream = ""  # the endpoint whose answer is relayed, for the access log

    @property
    def method(self) -> str:
        return self.request.method

    def finish(
        self,
        resp: web.StreamResponse,
        fate: Fate | str,
        attempts: int,
        *,
        proxy_error_code: str | None = None,
    ) -> web.StreamResponse:
        """The request ends with ``resp``: its span ended, ``SequenceEnded`` to the sinks."""
        if self.ended:
            return resp
        self.ended = True
        deps = self.deps
        trace_id: str | None = None
        if self.span is not None:
            deps.tracing.end_server(self.span, resp.status, str(fate), attempts, proxy_error_code)
            ids = TRACE.get()
            trace_id = ids[0] if ids is not None else None
        deps.events.sequence_ended(
            SequenceEnded(
                self.route.name,
                self.request.method,
                str(fate),
                attempts,
                deps.clock.monotonic() - self.start,
                resp.status,
                proxy_error=proxy_error_code,
                target=self.target,
                upstream=self.upstream,
                sent=resp.body_length,
                trace_id=trace_id,
            )
        )
        return resp

    def gone(self) -> None:
        """The client left before its answer: nobody to answer, nothing to blame upstream for."""
        if self.ended:
            return
        self.ended = True
        deps = self.deps
        if self.span is not None:
            deps.tracing.end_server(self.span, CLIENT_CLOSED, Fate.CLIENT_GONE.value, 0)
        deps.events.sequence_ended(
            SequenceEnded(
                self.route.name,
                self.request.method,
                Fate.CLIENT_GONE.value,
                0,
                deps.clock.monotonic() - self.start,
                CLIENT_CLOSED,
                proxy_error=None,
                target=self.target,
                upstream=self.upstream,
            )
        )

    def upstream_warning(self, message: str) -> None:
        """A warning about the route's upstream, logged at a bounded rate, as nginx does."""
        limit = self.warnings
        if limit.allow():
            suppressed = limit.suppressed
            more = f" ({suppressed} similar suppressed)" if suppressed else ""
            log.warning("route %s: %s%s", self.route.name, message, more)

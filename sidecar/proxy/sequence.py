"""One exchange through a route's whole policy: breaker admission, budget, bulkhead, attempts,
tracing and the breaker's one record. Used for client requests and for DLQ replays alike."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sidecar.config.model import Route
from sidecar.proxy import forward
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.gate import SequenceGate
from sidecar.retry.breaker import Admitted
from sidecar.retry.classify import may_resend, sequence_failed
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints, Fate
from sidecar.retry.loop import SequenceResult, run_sequence
from sidecar.upstream.client import Body, UpstreamResponse

if TYPE_CHECKING:
    from opentelemetry.trace import Span


@dataclass
class Exchange:
    route: Route
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]  # filtered and framed, without per-attempt headers
    body: Body
    chunked: bool
    replayable: bool  # the body is buffered and may be sent again
    edge: bytes | None  # a trusted incoming edge marker
    deadline: Deadline
    idempotency_key: bool
    span: Span | None = None


@dataclass
class Executed:
    result: SequenceResult | None  # None when the breaker refused the sequence
    retry_after: float = 0.0  # with a refusal: seconds until a probe is let through


async def execute(deps: ProxyDeps, sidecar_name: bytes, ex: Exchange) -> Executed:
    route = ex.route
    clock = deps.clock
    state = deps.states.get(route.name)
    now = clock.monotonic()
    admission = state.breaker.admit(now)
    if not isinstance(admission, Admitted):
        return Executed(None, admission.retry_after)
    state.budget.record_request(now)

    shared = list(ex.headers)
    # A trusted incoming marker is passed on unchanged; otherwise this sidecar is the edge.
    edge_value = ex.edge if ex.edge is not None and ex.edge != b"tracestate" else sidecar_name
    shared.append((b"x-retry-edge", edge_value))
    shared = forward.with_edge_tracestate(shared)
    head_base = forward.build_head(ex.method, ex.target, shared)
    head_only = ex.method == "HEAD"
    host, port = route.upstream.host, route.upstream.port
    client = deps.client
    bulkhead = state.bulkhead
    tracing = deps.tracing
    span = ex.span
    body, chunked, deadline, method = ex.body, ex.chunked, ex.deadline, ex.method
    upstream_name = route.upstream.authority

    def time_left() -> float:
        # Called once a streamed body has been sent: the deadline starts from there.
        deadline.restart(clock.monotonic())
        return deadline.remaining(clock.monotonic())

    async def send(attempt: int, timeout: float) -> UpstreamResponse:
        await bulkhead.acquire()
        remaining = deadline.remaining_ms(clock.monotonic())
        head = head_base + b"x-retry-attempt: %d\r\nx-request-timeout-ms: %d\r\n" % (
            attempt,
            remaining,
        )
        attempt_span = None
        if span is not None:
            attempt_span = tracing.start_attempt(span, method, attempt, upstream_name)
            head += b"traceparent: " + tracing.traceparent(attempt_span) + b"\r\n"
        try:
            up = await client.request(
                host, port, head + b"\r\n", body, timeout, head_only, chunked, time_left
            )
        except BaseException as exc:
            bulkhead.release()
            if attempt_span is not None:
                tracing.end_attempt(attempt_span, None, getattr(exc, "code", type(exc).__name__))
            raise
        if attempt_span is not None:
            tracing.end_attempt(attempt_span, up.status, None)
        up.on_done = bulkhead.release
        return up

    gate = SequenceGate(route.name, state, deps.kill, deps.life, clock)
    constraints = Constraints(
        may_resend=may_resend(route.retry, method, ex.idempotency_key),
        body_replayable=ex.replayable,
        edge_owned=ex.edge is not None,
        killed=gate.killed(),
    )
    try:
        result = await run_sequence(
            route, send, deadline, constraints, clock, deps.rng, deps.events, gate
        )
    except BaseException:
        # The client's side broke (body too large, disconnect): not the upstream's failure.
        state.breaker.record(clock.monotonic(), True, admission.probe, clock.wall())
        raise
    if result.fate is not Fate.OVERLOADED:
        failed = sequence_failed(route.retry, result.response_status, result.error is not None)
        state.breaker.record(clock.monotonic(), not failed, admission.probe, clock.wall())
    elif admission.probe:
        # The probe never reached the upstream: it says nothing either way; let it count as a
        # success so that the half-open state cannot wedge on local overload.
        state.breaker.record(clock.monotonic(), True, True, clock.wall())
    return Executed(result)

"""The DLQ hand-off, on the way back to the client: a write on a DLQ route that ended in a
transient failure is stored (``dlq/capture.py`` decides, the writer thread commits) before the
client hears anything; ``respond: accepted`` then answers 202 with the record's id. Also the
answer to a sequence the breaker refused."""

from __future__ import annotations

import json
import math

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.dlq.capture import capture
from sidecar.dlq.record import WRITE_METHODS, KeptBody
from sidecar.engine.answered import Answered
from sidecar.engine.sequence import Sequence
from sidecar.proxy.context import RequestContext
from sidecar.proxy.frontend import ResponseSink
from sidecar.proxy.relay import answer, dlq_fields
from sidecar.proxy.respond import Made, own_answer, proxy_status, send_made
from sidecar.upstream.client import Body


def wants_capture(ctx: RequestContext) -> bool:
    """Whether the DLQ is consulted for this request: a write on a route that has one."""
    return ctx.route.dlq.enabled and ctx.request.method in WRITE_METHODS and ctx.grpc is None


async def respond(ctx: RequestContext, sink: ResponseSink, seq: Sequence, body: Body) -> Answered:
    """The answer to the client, given inside the sequence's scope: the upstream response
    is relayed while the scope still owns it."""
    route = ctx.route
    result = seq.result
    error: str | None
    if result is None:  # the breaker refused the sequence
        fate, attempts, status, error = Fate.BREAKER_OPEN, 0, None, "breaker open"
    else:
        fate, attempts, status = result.fate, result.attempts, result.response_status
        error = str(result.error) if result.error is not None else None
    captured = None
    if wants_capture(ctx):  # skip the coroutine otherwise
        deps = ctx.deps
        captured = await capture(
            deps.dlq,
            route,
            ctx.request.method,
            ctx.target,
            ctx.as_received,
            KeptBody.of(body),
            fate=fate,
            attempts=attempts,
            final_status=status,
            error=error,
            on_write=deps.dlq_write,
            result=result,
        )
    if captured is not None and ctx.span is not None:
        ctx.deps.tracing.dlq_captured(ctx.span, captured.header, captured.record_id)
    if captured is not None and captured.record_id and route.dlq.respond == "accepted":
        return send_made(sink, accepted(captured.record_id, fate, attempts), fate, attempts)
    if result is None:
        made = own_answer(
            outcomes.BREAKER_OPEN,
            fate,
            0,
            message=f"circuit breaker of route {route.name} is open",
        )
        retry_after = b"%d" % max(1, math.ceil(seq.refused_for))
        made = made.plus([(b"Retry-After", retry_after), *dlq_fields(captured)])
        if ctx.span is not None:
            ctx.deps.tracing.breaker_refused(ctx.span, seq.refused_for)
        return send_made(sink, made, fate, 0, proxy_error=outcomes.BREAKER_OPEN.code)
    return await answer(ctx, sink, result, seq, captured=captured)


def accepted(record_id: str, fate: Fate, attempts: int) -> Made:
    """``respond: accepted``: 202 only once the record is durable on disk. Made by the sidecar
    itself, so it names itself in Proxy-Status (no error) and carries no Server banner."""
    rid = record_id.encode("latin-1")
    return Made(
        202,
        [
            (b"Content-Type", b"application/json"),
            (b"Proxy-Status", proxy_status().encode("latin-1")),
            (b"x-retry-attempts", b"%d" % attempts),
            (b"x-retry-fate", fate.value.encode("latin-1")),
            (b"x-retry-dlq", b"stored"),
            (b"x-retry-dlq-id", rid),
        ],
        json.dumps({"dlq_id": record_id}).encode(),
    )

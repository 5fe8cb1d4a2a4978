"""A write on a route that guards it (``idempotency``): the sequence run through the
idempotency guard (``sidecar/idempotency/guard.py``).

The guard reads the key, claims it and calls ``forward`` at most once, in a task of its own that
runs on when the client leaves (``detached.DetachedWrites``), so the key is settled by the app's
answer rather than given back; ``forward`` runs the
route's sequence (``run.run_sequence``, retries and DLQ hand-off included) with the answer held
(``held.HeldSink``) rather than sent, and says whether the route would retry it. Once the key is
settled (kept or released) the held answer goes to the client; the sidecar's own answers
(problems, replays) are sent instead and never reach the app.

The body of a guarded write must be whole to be fingerprinted: it is buffered up to the route's
``retry.max_body_bytes`` (the bound the route already buffers to resend); a larger one gets a 413
problem and is not sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
from email.utils import formatdate

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.engine.answered import Answered
from sidecar.idempotency.answer import Answer, Forwarded, forwarded_of
from sidecar.idempotency.guard import GuardResult, RequestView, body_too_large, guarded
from sidecar.idempotency.store import NOT_OPEN
from sidecar.proxy.context import RequestContext
from sidecar.proxy.frontend import Head
from sidecar.proxy.held import HeldSink
from sidecar.proxy.intake import Intake
from sidecar.proxy.respond import proxy_status
from sidecar.proxy.run import run_sequence

# The fate label (metrics, logs) of a request the guard answered itself: a replay is the
# write's earlier success, a problem (400, 409, 413, 422, 503) refuses it before the app.
REPLAYED_FATE = Fate.SUCCESS
REFUSED_FATE = Fate.NOT_RETRYABLE
# The fields every answer the sidecar makes itself carries (``_made``), lowercased.
OWN_FIELDS = frozenset({b"date", b"proxy-status"})


def guards(ctx: RequestContext) -> bool:
    return ctx.route.idempotency.guards(ctx.request.method)


def too_large(ctx: RequestContext) -> Answered:
    """The 413 for a guarded write whose body is over the bound (the rest is not read)."""
    key = next((v for k, v in ctx.headers if k.lower() == b"idempotency-key"), None)
    made = body_too_large(
        key.decode("latin-1") if key is not None else None, ctx.route.retry.max_body_bytes
    )
    ctx.deps.malformed("body-too-large")
    return _send(ctx, made, REFUSED_FATE, replayed=False, close=True)


def _send(
    ctx: RequestContext, answer: Answer, fate: Fate, *, replayed: bool, close: bool = False
) -> Answered:
    """The sidecar's own answer, a problem or a replay (a kept answer's headers are end-to-end
    only: framed anew; a 1xx, 204 or 304 carries no Content-Length, RFC 9110 8.6), with a
    ``Date`` and ``Proxy-Status`` (in place of any kept) as every answer the sidecar makes
    itself: a replay names the sidecar (no error), a problem the refusal's RFC 9209 error type
    (a store that cannot answer is the sidecar's own fault)."""
    status = answer.status
    bodiless = status < 200 or status in (204, 304)
    length = None if bodiless else len(answer.body)
    framing = [] if length is None else [(b"Content-Length", b"%d" % length)]
    error = None
    row = None  # a problem's row of the outcome table: a store down is the sidecar's own fault
    if not replayed:
        row = outcomes.IDEMPOTENCY_STORE if status == 503 else outcomes.BAD_REQUEST
        error = (
            row.proxy_status
            if row is outcomes.IDEMPOTENCY_STORE
            else outcomes.REFUSALS.get(status, outcomes.BAD_REQUEST.proxy_status)
        )
    own = [
        (b"Date", formatdate(ctx.deps.clock.wall(), usegmt=True).encode("ascii")),
        (b"Proxy-Status", proxy_status(error).encode("ascii")),
    ]
    if row is not None:  # as every answer the sidecar makes itself (docs/headers.md)
        own += [
            (b"x-retry-proxy-error", row.code.encode("ascii")),
            (b"x-retry-attempts", b"0"),
            (b"x-retry-fate", fate.value.encode("ascii")),
        ]
    # The sidecar's own fields replace the kept ones (a replay's Date, a replayed DLQ 202's
    # Proxy-Status): one of each, never two (Date is a singleton field, RFC 9110 6.6.1).
    kept = [(k, v) for k, v in answer.headers if k.lower() not in OWN_FIELDS]
    sink = ctx.sink
    sink.whole(Head(status, [*kept, *framing], own, length, close), answer.body)
    return Answered(
        status,
        answer.headers,
        fate.value,
        0,
        body=answer.body,
        sent=sink.sent,
        proxy_error=row.code if row is not None else None,
    )


async def run_guarded(ctx: RequestContext, intake: Intake) -> Answered:
    route = ctx.route
    body = intake.body
    assert body is None or isinstance(body, bytes), "a guarded write's body is buffered"
    deps = ctx.deps
    request = ctx.request
    view = RequestView(
        request.method,
        ctx.target.encode("latin-1"),
        tuple(ctx.headers),
        body or b"",
        route.timeout,
        route.name,
        received=tuple(request.raw_headers),  # the scope: read before anything is stripped
    )
    held = HeldSink(ctx.sink, route.idempotency.max_response_bytes)
    statuses = route.retry.retry_on.statuses
    got: list[Answered] = []

    async def forward() -> Forwarded:
        answered = await run_sequence(ctx, intake, held)
        got.append(answered)
        forwarded = forwarded_of(answered, statuses)
        if forwarded.body is None and held.body is not None:  # streamed whole into the hold
            forwarded = dataclasses.replace(forwarded, body=held.body)
        return forwarded

    def head_of() -> Forwarded | None:
        # The app's answer as far as it came, once its head came (the app acted): what
        # settles the key when the sequence ends without a result (the client gone
        # mid-body, a cancellation at stop). Its body is not kept.
        so_far = held.answered()
        return forwarded_of(so_far, statuses) if so_far is not None else None

    async def exchange() -> GuardResult:
        result = await guarded(
            route.idempotency,
            deps.idempotency or NOT_OPEN,
            view,
            forward,
            deps.clock,
            answered=head_of,
            holdings=deps.holdings,
        )
        if result.outcome is not None:
            deps.idempotency_result(route.name, result.outcome.value)
            if ctx.span is not None:
                deps.tracing.idempotency(ctx.span, result.outcome.value)
        return result

    # Its own task: a client that leaves cancels this handler, not the write (detached.py).
    work = deps.detached.start(exchange(), f"guarded-write {route.name}")
    try:
        result = await asyncio.shield(work)
    except asyncio.CancelledError:
        deps.detached.bound(work, ctx.deadline.remaining(deps.clock.monotonic()))
        raise
    answer = result.answer
    if isinstance(answer, Answer):  # a problem or a replay: the app was not called
        replayed = any(k == b"Idempotent-Replayed" for k, _ in answer.headers)
        return _send(ctx, answer, REPLAYED_FATE if replayed else REFUSED_FATE, replayed=replayed)
    # The app's answer (or the sidecar's own), held until its key was settled, or relayed
    # already as it came.
    return held.release(got[0])

"""A write on a route that guards it (``idempotency``): the sequence run through the
idempotency guard (``sidecar/idempotency/guard.py``).

The guard reads the key, claims it and calls ``forward`` at most once, in a task of its own that
runs on when the client leaves (``detached.DetachedWrites``), so the key is settled by the app's
answer rather than given back; ``forward`` runs the
route's sequence (``run.run_sequence``, retries and DLQ hand-off included) with the answer held
(``held.HeldAnswer``) rather than sent, and says whether the route would retry it. Once the key is
settled (kept or released) the held answer goes to the client; the sidecar's own answers
(problems, replays) are sent instead and never reach the app.

The body of a guarded write must be whole to be fingerprinted: it is buffered up to the route's
``retry.max_body_bytes`` (the bound the route already buffers to resend); a larger one gets a 413
problem and is not sent.
"""

from __future__ import annotations

import asyncio
from email.utils import formatdate

from aiohttp import web

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.idempotency.answer import Answer, Forwarded, not_begun
from sidecar.idempotency.guard import GuardResult, RequestView, body_too_large, guarded
from sidecar.idempotency.store import NOT_OPEN
from sidecar.proxy.context import RequestContext
from sidecar.proxy.held import HeldAnswer
from sidecar.proxy.intake import Intake
from sidecar.proxy.respond import ProxyResponse, proxy_status
from sidecar.proxy.run import run_sequence

# The fate label (metrics, logs) of a request the guard answered itself: a replay is the
# write's earlier success, a problem (400, 409, 413, 422, 503) refuses it before the app.
REPLAYED_FATE = Fate.SUCCESS
REFUSED_FATE = Fate.NOT_RETRYABLE
# The fields every answer the sidecar makes itself carries (``_made``), lowercased.
OWN_FIELDS = frozenset({b"date", b"proxy-status"})


def guards(ctx: RequestContext) -> bool:
    return ctx.route.idempotency.guards(ctx.request.method)


def too_large(ctx: RequestContext) -> web.StreamResponse:
    """The 413 for a guarded write whose body is over the bound (the rest is not read)."""
    key = next((v for k, v in ctx.headers if k.lower() == b"idempotency-key"), None)
    made = body_too_large(
        key.decode("latin-1") if key is not None else None, ctx.route.retry.max_body_bytes
    )
    resp = _made(ctx, made, replayed=False)
    resp.force_close()
    ctx.deps.malformed("body-too-large")
    return _send(ctx, resp, made.body, REFUSED_FATE)


def _made(ctx: RequestContext, answer: Answer, *, replayed: bool) -> ProxyResponse:
    """The sidecar's own answer, a problem or a replay (a kept answer's headers are end-to-end
    only: framed anew; a 1xx, 204 or 304 carries no Content-Length, RFC 9110 8.6), with a
    ``Date`` and ``Proxy-Status`` (in place of any kept) as every answer the sidecar makes
    itself: a replay names the
    sidecar (no error), a problem the refusal's RFC 9209 error type (a store that cannot answer
    is the sidecar's own fault)."""
    status = answer.status
    bodiless = status < 200 or status in (204, 304)
    length = None if bodiless else len(answer.body)
    framing = [] if length is None else [(b"Content-Length", b"%d" % length)]
    error = None
    if not replayed:
        error = (
            outcomes.INTERNAL.proxy_status
            if status == 503
            else outcomes.REFUSALS.get(status, outcomes.BAD_REQUEST.proxy_status)
        )
    own = [
        (b"Date", formatdate(ctx.deps.clock.wall(), usegmt=True).encode("ascii")),
        (b"Proxy-Status", proxy_status(error).encode("ascii")),
    ]
    # The sidecar's own fields replace the kept ones (a replay's Date, a replayed DLQ 202's
    # Proxy-Status): one of each, never two (Date is a singleton field, RFC 9110 6.6.1).
    kept = [(k, v) for k, v in answer.headers if k.lower() not in OWN_FIELDS]
    return ProxyResponse(status, [*kept, *framing], own, length)


def _send(
    ctx: RequestContext, resp: ProxyResponse, body: bytes, fate: Fate | str, attempts: int = 0
) -> web.StreamResponse:
    resp.send_whole(ctx.request, body)
    return ctx.finish(resp, fate, attempts)


def _headers(resp: web.StreamResponse) -> tuple[tuple[bytes, bytes], ...]:
    return tuple((k.encode("latin-1"), v.encode("latin-1")) for k, v in resp.headers.items())


def forwarded(ctx: RequestContext, held: HeldAnswer, resp: web.StreamResponse) -> Forwarded:
    """What the guard judges of the sequence's answer. The route would retry it (so the key is
    released): a status in ``retry_on``, an answer that says the app did not begin the write
    (``answer.not_begun``: 408, 425, 429, an error with ``Retry-After``), an answer a sidecar
    made itself (a connect failure, a reset, a timeout, an open breaker; an inner sidecar's
    too), but for one that stands for the app's answer (``outcomes.APP_ANSWERED``: a head it
    sent that cannot be relayed), which finishes the key with the 502 the client got. An
    answer whose body broke after its head came is the app's answer all the same: only its
    status is kept. A write the DLQ stored is not released: its key is finished with
    the answer the client got (202 or the failure with ``x-retry-dlq: stored``), so no
    duplicate runs it beside the DLQ's replay."""
    if held.resp is None and not held.streamed and not held.broken:
        # The sidecar's own answer (no upstream response, the DLQ's 202).
        own = resp.body if isinstance(resp, web.Response) else None
        body = own if isinstance(own, bytes) else None
        stored = resp.headers.get("x-retry-dlq") == "stored"
        # An answer the app gave that the sidecar could not relay (bad-response): the app
        # began the write, so the key is finished with the 502 the client got.
        app_answered = resp.headers.get("x-retry-proxy-error") in outcomes.APP_ANSWERED
        return Forwarded(resp.status, _headers(resp), body, not (stored or app_answered))
    # None: relayed as it came, or broken mid-body -- the app answered (the write took
    # effect), so its status is kept; a duplicate is told its answer was not kept.
    kept = held.body if held.resp is not None else None
    return _app_answer(ctx, held, resp.status, kept)


def head_of(ctx: RequestContext, held: HeldAnswer) -> Forwarded | None:
    """The app's answer as far as it came, once its head came (the app acted), else None: what
    settles the key when the sequence ends without a result (the client gone mid-body, a
    cancellation at stop). Its body is not kept."""
    if held.status is None:
        return None
    return _app_answer(ctx, held, held.status, None)


def _app_answer(
    ctx: RequestContext, held: HeldAnswer, status: int, body: bytes | None
) -> Forwarded:
    captured = held.captured
    stored = captured is not None and captured.record_id is not None
    retryable = held.made_by_sidecar or status in ctx.route.retry.retry_on.statuses
    # 408, 425, 429 and an error with Retry-After: the app did not begin the write.
    retryable = retryable or not_begun(status, held.headers)
    # The DLQ's headers are the sidecar's own end-to-end ones: part of the answer the client
    # got, so kept with it (a duplicate is told the write was stored, and under which id).
    headers = tuple(held.headers)
    if captured is not None:
        headers += ((b"x-retry-dlq", captured.header.encode("latin-1")),)
        if captured.record_id is not None:
            headers += ((b"x-retry-dlq-id", captured.record_id.encode("latin-1")),)
    return Forwarded(status, headers, body, retryable and not stored)


async def run_guarded(ctx: RequestContext, intake: Intake) -> web.StreamResponse:
    route = ctx.route
    body = intake.body
    assert body is None or isinstance(body, bytes), "a guarded write's body is buffered"
    deps = ctx.deps
    view = RequestView(
        ctx.request.method,
        ctx.target.encode("latin-1"),
        tuple(ctx.headers),
        body or b"",
        route.timeout,
        route.name,
        received=tuple(ctx.request.raw_headers),  # the scope: read before anything is stripped
    )
    held = HeldAnswer(route.idempotency.max_response_bytes)
    sent: list[web.StreamResponse] = []

    async def forward() -> Forwarded:
        ctx.held = held
        resp = await run_sequence(ctx, intake)
        sent.append(resp)
        return forwarded(ctx, held, resp)

    async def exchange() -> GuardResult:
        got = await guarded(
            route.idempotency,
            deps.idempotency or NOT_OPEN,
            view,
            forward,
            deps.clock,
            answered=lambda: head_of(ctx, held),
            holdings=deps.holdings,
        )
        if got.outcome is not None:
            deps.idempotency_result(route.name, got.outcome.value)
            if ctx.span is not None:
                deps.tracing.idempotency(ctx.span, got.outcome.value)
        return got

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
        made = _made(ctx, answer, replayed=replayed)
        return _send(ctx, made, answer.body, REPLAYED_FATE if replayed else REFUSED_FATE)
    if held.resp is not None:  # the app's answer, held until its key was settled
        return _send(ctx, held.resp, held.body, held.fate, held.attempts)
    return sent[0]  # relayed already, or the sidecar's own answer (sent by aiohttp)

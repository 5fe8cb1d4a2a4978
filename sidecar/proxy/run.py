"""The sequence run: the request's deadline and idempotency, the ``Exchange`` the engine
sends, and the ``Sequence`` scope around the answer (a tunnel opened, the upstream's response
relayed, or the DLQ hand-off and the sidecar's own answer), written through ``sink`` (the
front end's, or a guarded write's held one: ``proxy/held.py``)."""

from __future__ import annotations

from sidecar.engine.answered import Answered
from sidecar.engine.sequence import Exchange, Sequence
from sidecar.proxy.context import RequestContext
from sidecar.proxy.frontend import ResponseSink
from sidecar.proxy.h1 import H1Sink
from sidecar.proxy.handoff import respond, wants_capture
from sidecar.proxy.intake import Intake
from sidecar.proxy.relay import own_headers, stream
from sidecar.proxy.tunnel import not_opened, relay, switched


def exchange_of(ctx: RequestContext, intake: Intake) -> Exchange:
    """What the engine sends, bounded by the request's one deadline (``ctx.deadline``: counted
    from the end of the body, so a slow upload does not eat the upstream's time)."""
    route = ctx.route
    shared = ctx.headers
    # The key as it goes upstream: one the client named in Connection (hop-by-hop, so
    # dropped) is no key, and a POST without one is not resent.
    key = next((v for k, v in shared if k.lower() == b"idempotency-key"), None)
    return Exchange(
        route,
        ctx.request.method,
        ctx.target,
        shared,
        intake.body,
        intake.chunked,
        replayable=intake.replayable,
        edge=ctx.edge,
        deadline=ctx.deadline,
        idempotency_key=key is not None and key.strip() != b"",
        span=ctx.span,
        upgrade=ctx.upgrade is not None,
        grpc=ctx.grpc_call,
        replay=intake.replay,
    )


async def run_sequence(ctx: RequestContext, intake: Intake, sink: ResponseSink) -> Answered:
    deps = ctx.deps
    async with Sequence(deps, ctx.config.name.encode(), exchange_of(ctx, intake)) as seq:
        result = seq.result
        upgrade = ctx.upgrade
        if upgrade is not None:
            up = result.response if result is not None else None
            if result is not None and up is not None and switched(up):
                # An upgrade is asked for on HTTP/1.1 only (tunnel.upgrade_wanted): the tunnel
                # takes the HTTP/1.1 front end's connection over (never a held answer).
                front = ctx.sink
                assert isinstance(front, H1Sink)
                return await relay(
                    front,
                    ctx.route,
                    up,
                    upgrade,
                    own_headers(result, None),
                    deps.tunnels,
                    opened=ctx.end,
                    fate=result.fate.value,
                    attempts=result.attempts,
                )
            not_opened(deps.tunnels, ctx.route, up)
        if result is not None and result.response is not None and not wants_capture(ctx):
            # The common case (an upstream answer, no DLQ to consult) goes straight to the
            # relay: two coroutines less per request than through respond and answer.
            return await stream(ctx, sink, result, result.response, seq, captured=None)
        return await respond(ctx, sink, seq, intake.body)

"""Body intake: what a request's body is for the sequence. Buffered up to
``retry.max_body_bytes`` so it can be resent, streamed once beyond (``proxy/body.py`` reads
it), and framed for the upstream (Content-Length, or chunked when the client sent it so)."""

from __future__ import annotations

from sidecar.proxy.body import BodyStream, BodyTooLarge, ReplayBody, read_prefix
from sidecar.proxy.context import RequestContext
from sidecar.upstream.client import Body


class Intake:
    """The body as the sequence sends it."""

    __slots__ = ("body", "chunked", "replay", "replayable")

    def __init__(
        self, body: Body, chunked: bool, replayable: bool, replay: ReplayBody | None = None
    ) -> None:
        self.body = body
        self.chunked = chunked
        self.replayable = replayable  # buffered: it may be sent again
        self.replay = replay  # a stream kept while it fits (a gRPC call's): body is None


def no_body(ctx: RequestContext) -> Intake:
    """A request without a body (no coroutine: the common GET)."""
    if ctx.request.method in ("POST", "PUT", "PATCH"):
        ctx.headers.append((b"Content-Length", b"0"))
    return Intake(None, False, ctx.upgrade is None)  # an upgrade is sent once


def replay_body(ctx: RequestContext) -> Intake:
    """A gRPC call's request stream: sent as it arrives, kept up to ``retry.max_body_bytes``
    for a retry (``body.ReplayBody``)."""
    limits = ctx.config.limits
    max_total = limits.max_request_body
    replay = ReplayBody(
        ctx.request.body,
        min(ctx.route.retry.max_body_bytes, max_total),
        max_total,
        limits.body_idle_timeout,
    )
    length = ctx.request.content_length
    if length is not None:
        ctx.headers.append((b"Content-Length", str(length).encode()))
    return Intake(None, False, True, replay)  # replayable until it outgrows the buffer


async def read_body(ctx: RequestContext) -> Intake:
    """A request with a body. Raises ``BodyTooLarge``, ``BodyStalled``, ``BodyMalformed`` or
    ``ClientGone`` (``proxy/body.py``), which the handler answers."""
    request = ctx.request
    if ctx.expects_continue:
        await ctx.sink.interim(100, [])
    limits = ctx.config.limits
    idle = limits.body_idle_timeout
    max_total = limits.max_request_body
    limit = min(ctx.route.retry.max_body_bytes, max_total)
    prefix, ended = await read_prefix(request.body, limit, idle)
    if len(prefix) > max_total:  # a chunked body (no Content-Length to refuse early)
        raise BodyTooLarge(f"request body over {max_total} bytes")
    shared = ctx.headers
    if ended:
        ctx.deadline.restart(ctx.deps.clock.monotonic())  # the request is received: from now
        shared.append((b"Content-Length", str(len(prefix)).encode()))
        return Intake(prefix, False, ctx.upgrade is None)
    stream = BodyStream(request.body, prefix, max_total, idle)
    length = request.content_length
    if length is not None:
        shared.append((b"Content-Length", str(length).encode()))
        return Intake(stream, False, False)
    shared.append((b"Transfer-Encoding", b"chunked"))
    return Intake(stream, True, False)

"""The answer to the client once the sequence has a result: the upstream's response relayed
(its 1xx first, then the head, then the body, within ``stream_idle_timeout`` per read), or the
sidecar's own error answer when no response came. Runs inside the sequence's scope, which
still owns the upstream response."""

from __future__ import annotations

from aiohttp import web
from aiohttp.http import HttpVersion11

from sidecar import outcomes
from sidecar.core import Fate, NoTimeLeft, RetryStopped, UpstreamError
from sidecar.dlq.capture import Captured
from sidecar.engine.loop import SequenceResult
from sidecar.engine.sequence import Sequence
from sidecar.proxy import forward
from sidecar.proxy.context import RequestContext
from sidecar.proxy.respond import ProxyResponse, interim_head, own_answer
from sidecar.upstream.client import UpstreamResponse

# The fate label (metrics, logs) of a response whose upstream broke after its head went out:
# the client saw x-retry-fate: success in the head, but it is not counted as one.
BODY_BROKEN = "body-broken"
FULL_RESPONSE_MAX = 64 * 1024  # complete bodies up to this go out in one write


def own_headers(result: SequenceResult, captured: Captured | None) -> list[tuple[bytes, bytes]]:
    """The sidecar's own headers on a relayed response."""
    own = [
        (b"x-retry-attempts", b"%d" % result.attempts),
        (b"x-retry-fate", result.fate.value.encode()),
    ]
    if result.hedges:
        own.append((b"x-retry-hedges", b"%d" % result.hedges))
    if captured is not None:
        own.append((b"x-retry-dlq", captured.header.encode()))
        if captured.record_id is not None:
            own.append((b"x-retry-dlq-id", captured.record_id.encode()))
    return own


def dlq_headers(resp: web.StreamResponse, captured: Captured | None) -> None:
    """The DLQ's headers on an answer the sidecar makes itself."""
    if captured is not None:
        resp.headers["x-retry-dlq"] = captured.header
        if captured.record_id is not None:
            resp.headers["x-retry-dlq-id"] = captured.record_id


async def answer(
    ctx: RequestContext,
    result: SequenceResult,
    seq: Sequence,
    *,
    captured: Captured | None,
) -> web.StreamResponse:
    """The upstream's response relayed, or the error answer for a sequence that has none."""
    up = result.response
    if up is not None:
        return await stream(ctx, result, up, seq, captured=captured)
    fate = result.fate
    err = result.error
    assert err is not None
    row = err.answer
    error_type = err.error_type if isinstance(err, UpstreamError) else None
    if fate is Fate.DEADLINE:
        row, error_type = outcomes.DEADLINE, None
    elif isinstance(err, NoTimeLeft):
        # No time left for the attempt with the deadline not passed (else the fate
        # is deadline): its per-try timeout ended it, say waiting for a connection.
        row = outcomes.PER_TRY_TIMEOUT
    received = err.received_status if isinstance(err, RetryStopped) else None
    resp = own_answer(row, fate, result.attempts, error_type, received_status=received)
    dlq_headers(resp, captured)
    return ctx.finish(resp, fate, result.attempts, proxy_error_code=row.code)


async def stream(
    ctx: RequestContext,
    result: SequenceResult,
    up: UpstreamResponse,
    seq: Sequence,
    *,
    captured: Captured | None,
) -> web.StreamResponse:
    """Relay the upstream's response: whole in one write when it is already here and small,
    else head first and the body as it comes."""
    request = ctx.request
    ctx.upstream = up.endpoint
    held = ctx.held
    if held is not None:  # the head came: from here on the app has acted (proxy/guarded.py)
        held.status = up.status
        held.headers = forward.response_headers(up.headers)
        held.made_by_sidecar = up.proxy_error is not None
    if up.extra_data:
        ctx.upstream_warning("upstream sent more data after a complete response")
    if up.interim and request.version >= HttpVersion11:
        # RFC 9110 section 15.2: a proxy forwards 1xx responses (never to HTTP/1.0).
        # They go out in their order, just before the final response.
        for status, headers in up.interim:
            await request.writer.write(interim_head(status, forward.response_headers(headers)))
    idle = ctx.route.stream_idle_timeout
    whole = up.complete and (held is not None or up.buffered_bytes <= FULL_RESPONSE_MAX)
    raw = held.headers if held is not None else forward.response_headers(up.headers)
    resp = ProxyResponse(
        up.status, raw, own_headers(result, captured), up.content_length, flush_head=not whole
    )
    ahead: bytes | None = None  # a guarded write's body read ahead (proxy/held.py)
    if held is not None:
        held.captured = captured
        if not whole and up.has_body:
            try:
                ahead, whole = await held.read(up, idle)
            except UpstreamError as exc:
                return _broken_ahead(ctx, result, up, resp, seq, exc)
            except BaseException:
                up.discard()
                raise
        whole = whole or not up.has_body
    if whole:
        # The whole body is already here (the common small response): one write.
        if ahead is None:
            ahead = up.take_body() if up.has_body else b""
        body = ahead
        up.release()
        if held is not None:  # sent once its key is settled (proxy/guarded.py)
            held.hold(resp, raw, body, fate=result.fate, attempts=result.attempts)
            return resp
        # A client whose close came before this write (ConnectionError) is counted
        # client-gone by the handler, as every write to a client that left.
        resp.send_whole(request, body)
        return ctx.finish(resp, result.fate, result.attempts)
    broken: UpstreamError | None = None
    gone = False
    if held is not None:
        held.streamed = True
        resp._send_headers_immediately = True
    try:
        await resp.prepare(request)
        if ahead:
            await resp.write(ahead)
        if up.has_body:
            while True:
                chunk = await up.read_chunk(idle)
                if not chunk:
                    break
                await resp.write(chunk)
        up.release()
        await resp.write_eof()
    except UpstreamError as exc:
        # The upstream broke after the head went out: the client must see a broken
        # response (connection cut, no terminating chunk), never a truncated whole one.
        up.discard()
        seq.body_failed()  # the breaker hears of it: one failed sequence
        broken = exc
        resp.force_close()
        cut_transport(request)
    except (ConnectionError, OSError):
        up.discard()  # the client went away (its close came before the cancellation)
        gone = True
    except BaseException:
        up.discard()
        raise
    if broken is not None:
        # Not a success: counted under its own fate, logged (rate-limited) as nginx does.
        ctx.upstream_warning(f"upstream response broke mid-body ({broken.code}): {broken}")
        return ctx.finish(resp, BODY_BROKEN, result.attempts, proxy_error_code=broken.code)
    if gone:
        ctx.gone()
        return resp
    return ctx.finish(resp, result.fate, result.attempts)


def _broken_ahead(
    ctx: RequestContext,
    result: SequenceResult,
    up: UpstreamResponse,
    resp: ProxyResponse,
    seq: Sequence,
    exc: UpstreamError,
) -> web.StreamResponse:
    """A guarded write's upstream broke while its body was read ahead, before anything went
    to the client: as for any response broken mid-body, the client's connection is cut."""
    assert ctx.held is not None
    up.discard()
    seq.body_failed()
    ctx.held.broken = True
    resp.force_close()
    cut_transport(ctx.request)
    ctx.upstream_warning(f"upstream response broke mid-body ({exc.code}): {exc}")
    return ctx.finish(resp, BODY_BROKEN, result.attempts, proxy_error_code=exc.code)


def cut_transport(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()

"""The answer to the client once the sequence has a result, written through the request's
``ResponseSink`` (``proxy/frontend.py``): the upstream's response relayed (its 1xx first, then
the head, then the body, within ``stream_idle_timeout`` per read), or the sidecar's own error
answer when no response came. Runs inside the sequence's scope, which still owns the upstream
response. Returns the request's one ``Answered``."""

from __future__ import annotations

from sidecar import outcomes
from sidecar.core import Fate, NoTimeLeft, RetryStopped, UpstreamError
from sidecar.dlq.capture import Captured
from sidecar.engine.answered import Answered
from sidecar.engine.loop import SequenceResult
from sidecar.engine.sequence import Sequence
from sidecar.proxy import forward
from sidecar.proxy.context import RequestContext
from sidecar.proxy.frontend import Head, RawHeaders, ResponseSink
from sidecar.proxy.grpccall import GRPC_STATUS, status_in
from sidecar.proxy.respond import own_answer, send_made
from sidecar.upstream.client import UpstreamResponse

# The fate label (metrics, logs) of a response whose upstream broke after its head went out:
# the client saw x-retry-fate: success in the head, but it is not counted as one.
BODY_BROKEN = "body-broken"


def own_headers(result: SequenceResult, captured: Captured | None) -> RawHeaders:
    """The sidecar's own headers on a relayed response."""
    own = [
        (b"x-retry-attempts", b"%d" % result.attempts),
        (b"x-retry-fate", result.fate.encode()),  # a StrEnum: the str is its value
    ]
    if result.hedges:
        own.append((b"x-retry-hedges", b"%d" % result.hedges))
    return own + dlq_fields(captured) if captured is not None else own


def dlq_fields(captured: Captured | None) -> RawHeaders:
    """The DLQ's fields on an answer: what it did with the write, and the record's id."""
    if captured is None:
        return []
    fields = [(b"x-retry-dlq", captured.header.encode("latin-1"))]
    if captured.record_id is not None:
        fields.append((b"x-retry-dlq-id", captured.record_id.encode("latin-1")))
    return fields


async def answer(
    ctx: RequestContext,
    sink: ResponseSink,
    result: SequenceResult,
    seq: Sequence,
    *,
    captured: Captured | None,
) -> Answered:
    """The upstream's response relayed, or the error answer for a sequence that has none."""
    up = result.response
    if up is not None:
        return await stream(ctx, sink, result, up, seq, captured=captured)
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
    made = own_answer(row, fate, result.attempts, error_type, received_status=received)
    if isinstance(err, UpstreamError) and err.grpc > 0 and row is err.answer:
        # A gRPC call's last failure as gRPC reads it (a stream reset CANCEL is CANCELLED):
        # the status its gRPC answer carries (proxy/grpccall.py).
        made = made.plus([(GRPC_STATUS, b"%d" % err.grpc)])
    if captured is not None:
        made = made.plus(dlq_fields(captured))
    return send_made(sink, made, fate, result.attempts, proxy_error=row.code)


async def stream(
    ctx: RequestContext,
    sink: ResponseSink,
    result: SequenceResult,
    up: UpstreamResponse,
    seq: Sequence,
    *,
    captured: Captured | None,
) -> Answered:
    """Relay the upstream's response: whole in one write when it is already here and the sink
    takes it whole, else head first and the body as it comes."""
    if up.extra_data:
        ctx.upstream_warning("upstream sent more data after a complete response")
    for status, fields in up.interim:
        # RFC 9110 section 15.2: a proxy forwards 1xx responses, in their order, just before
        # the final response (the sink knows where the protocol has none).
        await sink.interim(status, forward.response_headers(fields))
    raw = forward.response_headers(up.headers)
    head = Head(
        up.status,
        raw,
        own_headers(result, captured),
        up.content_length,
        from_upstream=True,
        upstream_error=up.proxy_error,
    )
    # What a duplicate of a guarded write is told: the app's fields and the DLQ's.
    kept = (*raw, *dlq_fields(captured)) if captured is not None else tuple(raw)
    fate: str = result.fate  # a StrEnum: no .value lookup per request
    attempts = result.attempts
    trailers = up.trailers
    if trailers is None and (
        not up.has_body or (up.complete and up.buffered_bytes <= sink.whole_limit)
    ):
        # The whole body is already here (the common small response): one write.
        body = up.take_body() if up.has_body else b""
        up.release()
        # A client whose close came before this write (ConnectionError) is counted
        # client-gone by the handler, as every write to a client that left.
        sink.whole(head, body)
        return _answered(up, kept, fate, attempts, body, captured=captured, sent=sink.sent)
    idle = ctx.route.stream_idle_timeout
    try:
        await sink.start(head)
        while True:
            chunk = await up.read_chunk(idle)
            if not chunk:
                break
            await sink.write(chunk)
        trailers = up.trailers
        up.release()
        await sink.end(trailers)
        if trailers is not None and ctx.grpc is not None and committed_failure(ctx, trailers):
            seq.body_failed()  # a listed gRPC status after the call was committed
    except UpstreamError as exc:
        # The upstream broke after the head went out: the client must see a broken
        # response (connection cut, no terminating chunk), never a truncated whole one.
        up.discard()
        seq.body_failed()  # the breaker hears of it: one failed sequence
        sink.abort()
        # Not a success: counted under its own fate, logged (rate-limited) as nginx does.
        ctx.upstream_warning(f"upstream response broke mid-body ({exc.code}): {exc}")
        return Answered(
            up.status,
            kept,
            BODY_BROKEN,
            attempts,
            proxy_error=exc.code,
            from_upstream=True,
            upstream_error=up.proxy_error,
            dlq=captured.header if captured is not None else None,
            dlq_id=captured.record_id if captured is not None else None,
            sent=sink.sent,
            endpoint=up.endpoint,
        )
    except OSError as lost:
        # The client went away (its close came before the cancellation): the handler counts
        # it client-gone.
        up.discard()
        if isinstance(lost, ConnectionError):
            raise
        raise ConnectionResetError(str(lost)) from lost
    except BaseException:
        up.discard()
        raise
    return _answered(up, kept, fate, attempts, None, captured=captured, sent=sink.sent)


def committed_failure(ctx: RequestContext, trailers: RawHeaders) -> bool:
    """A gRPC call's trailers carry a status its route lists in ``retry_on``: too late to
    retry (its first message went out), but a failure for the breaker, as a listed 503."""
    code = status_in(trailers)
    return code > 0 and code in ctx.route.retry.retry_on.grpc


def _answered(
    up: UpstreamResponse,
    kept: tuple[tuple[bytes, bytes], ...],
    fate: str,
    attempts: int,
    body: bytes | None,
    *,
    captured: Captured | None,
    sent: int,
) -> Answered:
    return Answered(
        up.status,
        kept,
        fate,
        attempts,
        body=body,
        from_upstream=True,
        upstream_error=up.proxy_error,
        dlq=captured.header if captured is not None else None,
        dlq_id=captured.record_id if captured is not None else None,
        sent=sent,
        endpoint=up.endpoint,
    )

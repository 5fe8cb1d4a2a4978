"""The proxy handler: one request, step by step, each step in a module named for it.

0. the front end (``h1``: HTTP/1.1 on aiohttp's server) makes the request a ``ClientRequest``
   and gives the ``ResponseSink`` its answer goes out through (``frontend``);

1. ``admission``: the guards (head size, target, route, body size, expectation) and the
   request context every later step reads (``context``);
2. ``intake``: the body, buffered to be resent or streamed once;
3. ``run``: the ``Sequence`` scope, inside which ``relay`` relays the answer, ``handoff``
   stores a failed write in the DLQ first, and ``tunnel`` joins an upgraded connection; a write
   its route guards with an ``Idempotency-Key`` runs it through the guard (``guarded``).

Each step gives back the request's one ``Answered`` (``engine/answered.py``): what the client
got. This module maps what a step raises to the client's answer and ends the request with its
``Answered``, here and nowhere else (counted, its span ended: ``RequestContext.end``; a tunnel
is counted at its 101).
Routing and header rules are pure functions in ``routing`` and ``forward``; retry judgement is
in ``sidecar.retry``; upstream I/O is in ``sidecar.upstream``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

from aiohttp import web

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.engine.answered import Answered, client_gone
from sidecar.proxy.admission import admit
from sidecar.proxy.body import BodyMalformed, BodyStalled, BodyTooLarge, ClientGone
from sidecar.proxy.context import RequestContext
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.frontend import ClientRequest, ResponseSink
from sidecar.proxy.grpccall import GrpcSink, is_grpc
from sidecar.proxy.guarded import guards, run_guarded, too_large
from sidecar.proxy.h1 import H1Sink, client_request
from sidecar.proxy.intake import no_body, read_body, replay_body
from sidecar.proxy.respond import Made, own_answer, refusal, send_made
from sidecar.proxy.run import run_sequence
from sidecar.proxy.server import GuardedRequestHandler
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.proxy")


def _refuse(sink: ResponseSink, made: Made, *, close: bool = False) -> Answered:
    """An answer the sidecar makes itself as a step ended: client-gone if it cannot be
    written (the client's close came before this write)."""
    try:
        return send_made(sink, made, Fate.NOT_RETRYABLE, 0, close=close)
    except ConnectionError:
        sink.abort()
        return client_gone()


class ProxyHandler:
    def __init__(self, deps: ProxyDeps) -> None:
        self.deps = deps
        self._internal_errors = RateLimit(per_interval=5, interval=60.0)
        self._upstream_errors = RateLimit(per_interval=10, interval=60.0)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        sink = H1Sink(request)
        try:
            await self._handle(client_request(request), sink)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:
            # A bug before the request was routed (after it, _handle answers and counts it):
            # never a traceback per request, one bounded log line and a clean 502.
            if self._internal_errors.allow():
                log.exception("internal error while proxying %s", request.method)
            send_made(sink, own_answer(outcomes.INTERNAL, Fate.EXHAUSTED, 0), Fate.EXHAUSTED, 0)
        finally:
            proto = request.protocol
            if isinstance(proto, GuardedRequestHandler):
                proto.request_done()
        # aiohttp asks the response it is given for prepare, write_eof and keep_alive only:
        # the sink has written the answer already (proxy/h1.py).
        return cast(web.StreamResponse, sink)

    async def serve(self, request: ClientRequest, sink: ResponseSink) -> None:
        """One request of another front end (HTTP/2: ``proxy/h2conn.py``), run in a task of
        its own that its client's reset cancels."""
        try:
            await self._handle(request, sink)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:
            # A bug before the request was routed, as in ``__call__``.
            if self._internal_errors.allow():
                log.exception("internal error while proxying %s", request.method)
            made = own_answer(outcomes.INTERNAL, Fate.EXHAUSTED, 0)
            try:
                send_made(sink, made, Fate.EXHAUSTED, 0)
            except ConnectionError:
                sink.abort()

    async def _handle(self, request: ClientRequest, sink: ResponseSink) -> None:
        grpc: GrpcSink | None = None
        if request.method == "POST" and is_grpc(request.fields.get("Content-Type")):
            sink = grpc = GrpcSink(sink)  # the sidecar's own answers as gRPC answers
        ctx = admit(request, sink, self.deps, self._upstream_errors, grpc)
        if not isinstance(ctx, RequestContext):
            # Refused before any sequence: not counted as a request of a route.
            send_made(sink, ctx, Fate.NOT_RETRYABLE, 0)
            self.deps.refused(request.method, request.target, ctx.status)
            return
        deps = self.deps
        try:
            answered = await self._steps(ctx, request)
        except BodyTooLarge as exc:
            deps.malformed("body-too-large")
            # The rest of the body is not read: the connection closes after the answer.
            answered = _refuse(sink, refusal(413, str(exc)), close=True)
        except BodyStalled as stalled:  # not "exc": see tests/integration/test_build.py (mypyc)
            deps.malformed("body-timeout")
            answered = _refuse(sink, refusal(408, str(stalled)), close=True)
        except BodyMalformed as malformed:
            deps.malformed("malformed")
            # The connection's framing is lost.
            answered = _refuse(sink, refusal(400, str(malformed)), close=True)
        except ClientGone:
            # The client aborted its upload: nobody to answer, nothing to blame upstream for.
            sink.abort()
            answered = client_gone()
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client's connection is lost: every scope
            # below has given back what it held; count it and let the cancellation go on.
            ctx.end(client_gone())
            raise
        except ConnectionError:
            # A write to the client (100 Continue, a relayed 1xx, a whole answer written at
            # once) found its transport closing: its close arrived before aiohttp's
            # cancellation of this handler (a loop turn later). The same client that left;
            # every scope below has given back what it held.
            sink.abort()
            answered = client_gone()
        except Exception:
            # A bug must not become a traceback per request: one bounded log line, a clean 502,
            # and the request still counted and its span ended.
            if self._internal_errors.allow():
                log.exception("internal error while proxying %s", request.method)
            made = own_answer(outcomes.INTERNAL, Fate.EXHAUSTED, 0)
            try:
                answered = send_made(
                    sink, made, Fate.EXHAUSTED, 0, proxy_error=outcomes.INTERNAL.code
                )
            except ConnectionError:
                sink.abort()
                answered = client_gone()
        ctx.end(answered)

    async def _steps(self, ctx: RequestContext, request: ClientRequest) -> Answered:
        if ctx.grpc is not None:
            # Never guarded nor kept in the DLQ: a gRPC call follows gRPC's retry rules, its
            # request stream sent as it comes (a bidirectional call answers meanwhile).
            intake = replay_body(ctx) if request.has_body else no_body(ctx)
            return await run_sequence(ctx, intake, ctx.sink)
        if ctx.route.idempotency.enabled and guards(ctx):  # a write its route guards
            length = request.content_length
            if length is not None and length > ctx.route.retry.max_body_bytes:
                return too_large(ctx)
            intake = await read_body(ctx) if request.has_body else no_body(ctx)
            if not intake.replayable:  # not buffered whole: no fingerprint
                return too_large(ctx)
            return await run_guarded(ctx, intake)
        intake = await read_body(ctx) if request.has_body else no_body(ctx)
        return await run_sequence(ctx, intake, ctx.sink)

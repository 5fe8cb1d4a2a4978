"""The proxy handler: one request, step by step, each step in a module named for it.

1. ``admission``: the guards (head size, target, route, body size, expectation) and the
   request context every later step reads (``context``);
2. ``intake``: the body, buffered to be resent or streamed once;
3. ``run``: the ``Sequence`` scope, inside which ``relay`` relays the answer, ``handoff``
   stores a failed write in the DLQ first, and ``tunnel`` joins an upgraded connection; a write
   its route guards with an ``Idempotency-Key`` runs it through the guard (``guarded``).

This module maps what a step raises to the client's answer and counts how the request ended.
Routing and header rules are pure functions in ``routing`` and ``forward``; retry judgement is
in ``sidecar.retry``; upstream I/O is in ``sidecar.upstream``.
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web

from sidecar import outcomes
from sidecar.core import Fate
from sidecar.proxy.admission import admit
from sidecar.proxy.body import BodyMalformed, BodyStalled, BodyTooLarge, ClientGone
from sidecar.proxy.context import RequestContext
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.guarded import guards, run_guarded, too_large
from sidecar.proxy.intake import no_body, read_body
from sidecar.proxy.relay import cut_transport
from sidecar.proxy.respond import client_error, own_answer
from sidecar.proxy.run import run_sequence
from sidecar.proxy.server import GuardedRequestHandler
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.proxy")


class ProxyHandler:
    def __init__(self, deps: ProxyDeps) -> None:
        self.deps = deps
        self._internal_errors = RateLimit(per_interval=5, interval=60.0)
        self._upstream_errors = RateLimit(per_interval=10, interval=60.0)

    async def __call__(self, request: web.BaseRequest) -> web.StreamResponse:
        try:
            return await self._handle(request)
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:
            # A bug before the request was routed (after it, _handle answers and counts it):
            # never a traceback per request, one bounded log line and a clean 502.
            if self._internal_errors.allow():
                log.exception("internal error while proxying %s", request.method)
            return own_answer(outcomes.INTERNAL, Fate.EXHAUSTED, 0)
        finally:
            proto = request.protocol
            if isinstance(proto, GuardedRequestHandler):
                proto.request_done()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        ctx = admit(request, self.deps, self._upstream_errors)
        if not isinstance(ctx, RequestContext):
            return ctx  # refused before any sequence
        try:
            if guards(ctx):  # a write its route guards with an Idempotency-Key
                length = request.content_length
                if length is not None and length > ctx.route.retry.max_body_bytes:
                    return too_large(ctx)
                intake = await read_body(ctx) if request.body_exists else no_body(ctx)
                if not intake.replayable:  # not buffered whole: no fingerprint
                    return too_large(ctx)
                return await run_guarded(ctx, intake)
            intake = await read_body(ctx) if request.body_exists else no_body(ctx)
            return await run_sequence(ctx, intake)
        except BodyTooLarge as exc:
            self.deps.malformed("body-too-large")
            resp413 = client_error(413, str(exc))
            resp413.force_close()  # the rest of the body is not read
            return ctx.finish(resp413, Fate.NOT_RETRYABLE, 0)
        except BodyStalled as stalled:  # not "exc": see tests/integration/test_build.py (mypyc)
            self.deps.malformed("body-timeout")
            resp408 = client_error(408, str(stalled))
            resp408.force_close()
            return ctx.finish(resp408, Fate.NOT_RETRYABLE, 0)
        except BodyMalformed as malformed:
            self.deps.malformed("malformed")
            resp400 = client_error(400, str(malformed))
            resp400.force_close()  # the connection's framing is lost
            return ctx.finish(resp400, Fate.NOT_RETRYABLE, 0)
        except ClientGone:
            # The client aborted its upload: nobody to answer, nothing to blame upstream for.
            ctx.gone()
            cut_transport(request)
            return client_error(400, "the request body did not arrive whole")
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client's connection is lost: every scope
            # below has given back what it held; count it and let the cancellation go on.
            ctx.gone()
            raise
        except ConnectionError:
            # A write to the client (100 Continue, a relayed 1xx, a whole answer written at
            # once) found its transport closing: its close arrived before aiohttp's
            # cancellation of this handler (a loop turn later). The same client that left;
            # every scope below has given back what it held.
            ctx.gone()
            cut_transport(request)
            return client_error(400, "the client closed the connection")
        except Exception:
            # A bug must not become a traceback per request: one bounded log line, a clean 502,
            # and the request still counted and its span ended.
            if self._internal_errors.allow():
                log.exception("internal error while proxying %s", request.method)
            resp = own_answer(outcomes.INTERNAL, Fate.EXHAUSTED, 0)
            return ctx.finish(resp, Fate.EXHAUSTED, 0, proxy_error_code=outcomes.INTERNAL.code)

"""The proxy handler: route, read the body, admit, run the retry sequence, answer.

It is deliberately thin: routing and header rules are pure functions in ``routing`` and
``forward``; retry judgement is in ``sidecar.retry``; upstream I/O is in ``sidecar.upstream``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import math
from typing import TYPE_CHECKING

from aiohttp import web
from aiohttp.http import HttpVersion11

from sidecar import outcomes
from sidecar.config.model import Config, IpNetwork, Route
from sidecar.core import Fate, NoTimeLeft, RetryStopped, UpstreamError
from sidecar.dlq.capture import Captured, capture
from sidecar.dlq.record import WRITE_METHODS, KeptBody
from sidecar.engine.loop import SequenceResult
from sidecar.engine.sequence import Exchange, Sequence
from sidecar.proxy import forward
from sidecar.proxy.body import (
    BodyMalformed,
    BodyStalled,
    BodyStream,
    BodyTooLarge,
    ClientGone,
    read_prefix,
)
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.respond import (
    ProxyResponse,
    SidecarResponse,
    client_error,
    interim_head,
    own_answer,
    proxy_status,
)
from sidecar.proxy.routing import Refused, find_route, request_target
from sidecar.proxy.server import GuardedRequestHandler, transport_peer
from sidecar.proxy.tunnel import not_opened, relay, switched, upgrade_headers, upgrade_wanted
from sidecar.retry.deadline import Deadline, parse_timeout_ms
from sidecar.telemetry.events import SequenceEnded
from sidecar.telemetry.logs import RateLimit
from sidecar.upstream.client import Body, UpstreamResponse

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("sidecar.proxy")

# The fate label (metrics, logs) of a response whose upstream broke after its head went out:
# the client saw x-retry-fate: success in the head, but it is not counted as one.
BODY_BROKEN = "body-broken"
FULL_RESPONSE_MAX = 64 * 1024  # complete bodies up to this go out in one write


def peer_of(request: web.BaseRequest) -> str:
    proto = request.protocol
    if isinstance(proto, GuardedRequestHandler):
        return proto.peer()
    return transport_peer(request.transport)


_TRUST_CACHE: dict[str, bool] = {}
_TRUST_NETS: list[tuple[IpNetwork, ...]] = [()]


def is_trusted(peer: str, networks: tuple[IpNetwork, ...]) -> bool:
    """Cached per peer address: parsing it on every request cost ~2% of the CPU. The cache is
    dropped when a reload brings other networks, and bounded against address churn."""
    if networks is not _TRUST_NETS[0]:
        _TRUST_NETS[0] = networks
        _TRUST_CACHE.clear()
    hit = _TRUST_CACHE.get(peer)
    if hit is not None:
        return hit
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(peer)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
        trusted = any(addr in net for net in networks)
    except ValueError:
        trusted = False
    if len(_TRUST_CACHE) >= 4096:
        _TRUST_CACHE.clear()
    _TRUST_CACHE[peer] = trusted
    return trusted


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
        deps = self.deps
        config: Config = deps.store.current  # one snapshot for the whole sequence
        method = request.method
        target = request.raw_path
        raw_headers = request.raw_headers
        head_bytes = len(target) + sum(len(k) + len(v) + 4 for k, v in raw_headers)
        if head_bytes > config.limits.max_header_bytes:
            deps.malformed("header-too-large")
            return client_error(
                431, f"request head of {head_bytes} bytes is over {config.limits.max_header_bytes}"
            )
        where = request_target(method, target, request.headers.get("Host"))
        if isinstance(where, Refused):
            return client_error(where.status, where.message)
        target, path = where.origin, where.path
        route = find_route(config.routes, method, path, request.headers.get)
        if route is None:
            return client_error(404, f"no route matches {method} {path}")

        length = request.content_length
        if length is not None and length > config.limits.max_request_body:
            deps.malformed("body-too-large")
            return client_error(
                413, f"request body of {length} bytes is over {config.limits.max_request_body}"
            )

        expect = request.headers.get("Expect")
        if expect is not None and expect.lower() != "100-continue":
            return client_error(417, f"unsupported expectation {expect!r}")

        peer = peer_of(request)
        trusted = is_trusted(peer, config.trusted_peers)
        shared, edge, timeout_ms = forward.request_headers(
            raw_headers,
            peer,
            trusted,
            default_host=route.upstream.authority.encode(),
            authority=where.authority.encode("latin-1") if where.authority else None,
        )
        upgrade = upgrade_wanted(request, route)  # a tunnel asked for (proxy/tunnel.py)
        if upgrade is not None:
            shared.extend(upgrade_headers(upgrade))
        tracing = deps.tracing
        span: Span | None = None
        if tracing.enabled:
            span = tracing.start_server(method, target, route.name, request.headers, peer)
            # Our attempt spans become the parent the upstream sees.
            shared = [(k, v) for k, v in shared if k.lower() != b"traceparent"]
        # What a DLQ record keeps (before framing). Read only when the route has a DLQ: the
        # copy is skipped otherwise.
        as_received = list(shared) if route.dlq.enabled else shared
        clock = deps.clock
        start = clock.monotonic()
        try:
            if expect is not None and request.version == (1, 1) and request.body_exists:
                # The low-level aiohttp server does not answer Expect itself (its router does):
                # without this a client waits its expect timeout (curl: 1 s) before sending.
                await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            return await self._sequence(
                request,
                config,
                route,
                target,
                shared,
                as_received,
                edge=edge,
                timeout_ms=timeout_ms,
                start=start,
                span=span,
                upgrade=upgrade,
            )
        except BodyTooLarge as exc:
            deps.malformed("body-too-large")
            resp413 = client_error(413, str(exc))
            resp413.force_close()  # the rest of the body is not read
            return self._finish(request, route, start, resp413, Fate.NOT_RETRYABLE, 0, span=span)
        except BodyStalled as stalled:  # not "exc": see tests/test_build.py (mypyc)
            deps.malformed("body-timeout")
            resp408 = client_error(408, str(stalled))
            resp408.force_close()
            return self._finish(request, route, start, resp408, Fate.NOT_RETRYABLE, 0, span=span)
        except BodyMalformed as malformed:
            deps.malformed("malformed")
            resp400 = client_error(400, str(malformed))
            resp400.force_close()  # the connection's framing is lost
            return self._finish(request, route, start, resp400, Fate.NOT_RETRYABLE, 0, span=span)
        except ClientGone:
            # The client aborted its upload: nobody to answer, nothing to blame upstream for.
            self._gone(request, route, start, span)
            _cut_transport(request)
            return client_error(400, "the request body did not arrive whole")
        except asyncio.CancelledError:
            # aiohttp cancels the handler when the client's connection is lost: every scope
            # below has given back what it held; count it and let the cancellation go on.
            self._gone(request, route, start, span)
            raise
        except ConnectionError:
            # A write to the client (100 Continue, a relayed 1xx, a whole answer written at
            # once) found its transport closing: its close arrived before aiohttp's
            # cancellation of this handler (a loop turn later). The same client that left;
            # every scope below has given back what it held.
            self._gone(request, route, start, span)
            _cut_transport(request)
            return client_error(400, "the client closed the connection")
        except Exception:
            # A bug must not become a traceback per request: one bounded log line, a clean 502,
            # and the request still counted and its span ended.
            if self._internal_errors.allow():
                log.exception("internal error while proxying %s", request.method)
            resp = own_answer(outcomes.INTERNAL, Fate.EXHAUSTED, 0)
            return self._finish(
                request,
                route,
                start,
                resp,
                Fate.EXHAUSTED,
                0,
                proxy_error_code=outcomes.INTERNAL.code,
                span=span,
            )

    async def _sequence(
        self,
        request: web.BaseRequest,
        config: Config,
        route: Route,
        target: str,  # origin-form, as request_target read it
        shared: list[tuple[bytes, bytes]],
        as_received: list[tuple[bytes, bytes]],
        *,
        edge: bytes | None,
        timeout_ms: bytes | None,
        start: float,
        span: Span | None,
        upgrade: bytes | None = None,
    ) -> web.StreamResponse:
        deps = self.deps
        method = request.method
        # Body: buffered up to max_body_bytes so it can be resent; streamed once beyond.
        body: Body = None
        chunked = False
        replayable = upgrade is None  # an upgrade is sent once (a connect failure aside)
        if request.body_exists:
            idle = config.limits.body_idle_timeout
            max_total = config.limits.max_request_body
            limit = min(route.retry.max_body_bytes, max_total)
            prefix, ended = await read_prefix(request, limit, idle)
            if len(prefix) > max_total:  # a chunked body (no Content-Length to refuse early)
                raise BodyTooLarge(f"request body over {max_total} bytes")
            if ended:
                body = prefix
                shared.append((b"Content-Length", str(len(prefix)).encode()))
            else:
                replayable = False
                body = BodyStream(request, prefix, config.limits.max_request_body, idle)
                length = request.content_length
                if length is not None:
                    shared.append((b"Content-Length", str(length).encode()))
                else:
                    chunked = True
                    shared.append((b"Transfer-Encoding", b"chunked"))
        elif method in ("POST", "PUT", "PATCH"):
            shared.append((b"Content-Length", b"0"))

        # The sequence deadline starts once the request is received (as Envoy's route timeout
        # does): a slow upload of a buffered body does not eat the upstream's time.
        deadline = Deadline.start(
            deps.clock.monotonic(), route.timeout, parse_timeout_ms(_s(timeout_ms))
        )
        # The key as it goes upstream: one the client named in Connection (hop-by-hop, so
        # dropped) is no key, and a POST without one is not resent.
        key = next((v for k, v in shared if k.lower() == b"idempotency-key"), None)
        exchange = Exchange(
            route,
            method,
            target,
            shared,
            body,
            chunked,
            replayable=replayable,
            edge=edge,
            deadline=deadline,
            idempotency_key=key is not None and key.strip() != b"",
            span=span,
            upgrade=upgrade is not None,
        )
        async with Sequence(deps, config.name.encode(), exchange) as seq:
            result = seq.result
            if upgrade is not None:
                up = result.response if result is not None else None
                if result is not None and up is not None and switched(up):
                    return await relay(
                        request,
                        route,
                        up,
                        upgrade,
                        _headers(result, None),
                        deps.tunnels,
                        opened=lambda resp: self._finish(
                            request, route, start, resp, result.fate, result.attempts, span=span
                        ),
                    )
                not_opened(deps.tunnels, route, up)
            if (
                result is not None
                and result.response is not None
                and not (route.dlq.enabled and method in WRITE_METHODS)
            ):
                # The common case (an upstream answer, no DLQ to consult) goes straight to the
                # relay: two coroutines less per request than through _respond and _answer.
                return await self._stream(
                    request, route, start, result, result.response, span, captured=None, seq=seq
                )
            return await self._respond(
                request, route, method, target, as_received, body, start=start, span=span, seq=seq
            )

    async def _respond(
        self,
        request: web.BaseRequest,
        route: Route,
        method: str,
        target: str,
        as_received: list[tuple[bytes, bytes]],
        body: Body,
        *,
        start: float,
        span: Span | None,
        seq: Sequence,
    ) -> web.StreamResponse:
        """The answer to the client, given inside the sequence's scope: the upstream response
        is relayed while the scope still owns it."""
        deps = self.deps
        result = seq.result
        error: str | None
        if result is None:  # the breaker refused the sequence
            fate, attempts, status, error = Fate.BREAKER_OPEN, 0, None, "breaker open"
        else:
            fate, attempts, status = result.fate, result.attempts, result.response_status
            error = str(result.error) if result.error is not None else None
        captured = None
        if route.dlq.enabled and method in WRITE_METHODS:  # skip the coroutine otherwise
            captured = await capture(
                deps.dlq,
                route,
                method,
                target,
                as_received,
                KeptBody.of(body),
                fate=fate,
                attempts=attempts,
                final_status=status,
                error=error,
                on_write=deps.dlq_write,
                result=result,
            )
        if captured is not None and captured.record_id and route.dlq.respond == "accepted":
            resp202 = accepted(captured.record_id, fate, attempts)
            return self._finish(request, route, start, resp202, fate, attempts, span=span)
        if result is None:
            resp = own_answer(
                outcomes.BREAKER_OPEN,
                fate,
                0,
                message=f"circuit breaker of route {route.name} is open",
            )
            resp.headers["Retry-After"] = str(max(1, math.ceil(seq.refused_for)))
            _dlq_headers(resp, captured)
            return self._finish(
                request,
                route,
                start,
                resp,
                fate,
                0,
                proxy_error_code=outcomes.BREAKER_OPEN.code,
                span=span,
            )
        return await self._answer(request, route, start, result, span, captured, seq=seq)

    def _gone(
        self, request: web.BaseRequest, route: Route, start: float, span: Span | None
    ) -> None:
        if span is not None:
            self.deps.tracing.end_server(span, 499, Fate.CLIENT_GONE.value, 0)
        self.deps.events.sequence_ended(
            SequenceEnded(
                route.name,
                request.method,
                Fate.CLIENT_GONE.value,
                0,
                self.deps.clock.monotonic() - start,
                499,  # nginx's status for "client closed the request", in metrics and logs
                proxy_error=None,
            )
        )

    def _finish(
        self,
        request: web.BaseRequest,
        route: Route,
        start: float,
        resp: web.StreamResponse,
        fate: Fate | str,
        attempts: int,
        *,
        proxy_error_code: str | None = None,
        span: Span | None = None,
    ) -> web.StreamResponse:
        if span is not None:
            self.deps.tracing.end_server(span, resp.status, str(fate), attempts)
        self.deps.events.sequence_ended(
            SequenceEnded(
                route.name,
                request.method,
                str(fate),
                attempts,
                self.deps.clock.monotonic() - start,
                resp.status,
                proxy_error=proxy_error_code,
            )
        )
        return resp

    async def _answer(
        self,
        request: web.BaseRequest,
        route: Route,
        start: float,
        result: SequenceResult,
        span: Span | None,
        captured: Captured | None,
        *,
        seq: Sequence,
    ) -> web.StreamResponse:
        fate = result.fate
        up = result.response
        if up is None:
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
            _dlq_headers(resp, captured)
            return self._finish(
                request,
                route,
                start,
                resp,
                fate,
                result.attempts,
                proxy_error_code=row.code,
                span=span,
            )
        return await self._stream(
            request, route, start, result, up, span, captured=captured, seq=seq
        )

    async def _stream(
        self,
        request: web.BaseRequest,
        route: Route,
        start: float,
        result: SequenceResult,
        up: UpstreamResponse,
        span: Span | None,
        *,
        captured: Captured | None,
        seq: Sequence,
    ) -> web.StreamResponse:
        if up.extra_data:
            self._upstream_warning(route, "upstream sent more data after a complete response")
        if up.interim and request.version >= HttpVersion11:
            # RFC 9110 section 15.2: a proxy forwards 1xx responses (never to HTTP/1.0).
            # They go out in their order, just before the final response.
            for status, headers in up.interim:
                await request.writer.write(interim_head(status, forward.response_headers(headers)))
        whole = up.complete and up.buffered_bytes <= FULL_RESPONSE_MAX
        resp = ProxyResponse(
            up.status,
            forward.response_headers(up.headers),
            _headers(result, captured),
            up.content_length,
            flush_head=not whole,
        )
        if whole:
            # The whole body is already here (the common small response): one write.
            body = up.take_body() if up.has_body else b""
            up.release()
            # A client whose close came before this write (ConnectionError) is counted
            # client-gone by _handle, as every write to a client that left.
            resp.send_whole(request, body)
            return self._finish(
                request, route, start, resp, result.fate, result.attempts, span=span
            )
        idle = route.stream_idle_timeout
        broken: UpstreamError | None = None
        gone = False
        try:
            await resp.prepare(request)
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
            _cut(request, resp)
        except (ConnectionError, OSError):
            up.discard()  # the client went away (its close came before the cancellation)
            gone = True
        except BaseException:
            up.discard()
            raise
        if broken is not None:
            # Not a success: counted under its own fate, logged (rate-limited) as nginx does.
            self._upstream_warning(
                route, f"upstream response broke mid-body ({broken.code}): {broken}"
            )
            return self._finish(
                request,
                route,
                start,
                resp,
                BODY_BROKEN,
                result.attempts,
                proxy_error_code=broken.code,
                span=span,
            )
        if gone:
            self._gone(request, route, start, span)
            return resp
        return self._finish(request, route, start, resp, result.fate, result.attempts, span=span)

    def _upstream_warning(self, route: Route, message: str) -> None:
        if self._upstream_errors.allow():
            suppressed = self._upstream_errors.suppressed
            more = f" ({suppressed} similar suppressed)" if suppressed else ""
            log.warning("route %s: %s%s", route.name, message, more)


def _headers(result: SequenceResult, captured: Captured | None) -> list[tuple[bytes, bytes]]:
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


def _dlq_headers(resp: web.StreamResponse, captured: Captured | None) -> None:
    if captured is not None:
        resp.headers["x-retry-dlq"] = captured.header
        if captured.record_id is not None:
            resp.headers["x-retry-dlq-id"] = captured.record_id


def accepted(record_id: str, fate: Fate, attempts: int) -> web.Response:
    """``respond: accepted``: 202 only once the record is durable on disk. Made by the sidecar
    itself, so it names itself in Proxy-Status (no error) and carries no Server banner."""
    return SidecarResponse(
        status=202,
        body=json.dumps({"dlq_id": record_id}).encode(),
        headers={
            "Content-Type": "application/json",
            "Proxy-Status": proxy_status(),
            "x-retry-attempts": str(attempts),
            "x-retry-fate": fate.value,
            "x-retry-dlq": "stored",
            "x-retry-dlq-id": record_id,
        },
    )


def _cut(request: web.BaseRequest, resp: web.StreamResponse) -> None:
    resp.force_close()
    _cut_transport(request)


def _cut_transport(request: web.BaseRequest) -> None:
    transport = request.transport
    if transport is not None:
        transport.abort()


def _s(v: bytes | None) -> str | None:
    return v.decode("latin-1") if v is not None else None

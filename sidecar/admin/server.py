"""The admin API on its own listener, loopback by default (docs/architecture.md).

JSON in and out; errors are ``{"error": "..."}`` with a 4xx. One middleware (``guard``)
judges every request before its handler: who may talk to this listener at all (``origin``:
the Host allow-list, no cross-site request; without a token, a form post only for a loopback
Host), then the token (with one configured, every
non-GET call and every DLQ call needs ``Authorization: Bearer <token>``), then the body type
(JSON bodies only as ``application/json``), then reads the body (whole, within
``limits.body_idle_timeout``: 408 otherwise); and it logs a handler's exception with its
traceback, at most 10 a minute (a client gone is no failure: not logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from sidecar.admin.auth import bearer_ok
from sidecar.admin.killswitch import (
    BadRequest,
    KillSwitch,
    Switch,
    audit_lift,
    audit_set,
    check_set,
)
from sidecar.admin.origin import Refusal, form_host_refusal, host_refusal, site_refusal
from sidecar.config.model import Route
from sidecar.config.render import as_json, settings_json
from sidecar.config.store import ConfigStore
from sidecar.config.watch import Reloader
from sidecar.core import Clock
from sidecar.engine.figures import RouteFigureSource
from sidecar.fleet.connection import FleetUnavailable
from sidecar.jsonapi import ExtraRoute, Handler, error, iso, loads_json
from sidecar.lifecycle import Lifecycle
from sidecar.telemetry.logs import RateLimit
from sidecar.telemetry.metrics import Metrics

log = logging.getLogger("sidecar.admin")
audit = logging.getLogger("sidecar.audit")

MAX_ADMIN_BODY = 64 * 1024
JSON_TYPE = "application/json"
# What every admin answer carries unless its handler set its own (the status page sets a CSP
# with its style hash): no framing, no MIME sniffing, no copy kept by a browser or a proxy
# (DLQ bodies, the config, the status are no one else's to cache). No ``Server`` banner.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "default-src 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-store",
}
# Routes that authenticate the request themselves: (method, path, handler).
FormRoute = tuple[str, str, Handler]


def _canonical(request: web.Request) -> str | None:
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else None


def local_address(request: web.Request) -> str | None:
    """The address the request's connection arrived at (the listener's own address on that
    interface), or None."""
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    return str(sock[0]) if isinstance(sock, tuple) and sock else None


@dataclass
class AdminDeps:
    store: ConfigStore
    reloader: Reloader | None
    kill: KillSwitch
    figures: RouteFigureSource
    metrics: Metrics
    life: Lifecycle
    clock: Clock
    token: str | None
    stats: Callable[[], dict[str, Any]] = dict
    # A refused token: (who, via, call); counted and logged (auth.FailedLogins).
    failed_login: Callable[[str, str, str], None] = lambda who, via, call: None


async def secure_answer(request: web.Request, resp: web.StreamResponse) -> None:
    """``on_response_prepare``: every answer the admin application makes (its handlers', the
    guard's refusals, the DLQ's and idempotency endpoints') gets ``SECURITY_HEADERS`` and no
    ``Server`` banner, as the proxy's own answers. (The listener's own refusals, 400, 408 and
    431 before any handler, are made by ``listener.refusal``.)"""
    headers = resp.headers
    for name, value in SECURITY_HEADERS.items():
        headers.setdefault(name, value)
    headers.popall("Server", None)


def switch_json(s: Switch) -> dict[str, Any]:
    return dict(s.as_json(), set_at=iso(s.set_at), expires_at=iso(s.expires_at))


def route_json(r: Route) -> dict[str, Any]:
    """Every key of the route, from the schema; ``upstream`` its first endpoint, as before."""
    return dict(as_json(r), upstream=str(r.upstream), upstreams=[str(u) for u in r.upstreams])


def build_admin_app(
    deps: AdminDeps,
    extra: list[ExtraRoute] | None = None,
    forms: list[FormRoute] | None = None,
) -> web.Application:
    token_for_get: set[str] = set()
    # The status page's form posts carry the token in their body and check it themselves
    # (sidecar.admin.formauth): a browser without JavaScript cannot send a header.
    self_checked: set[str] = set()

    # admin.listen is bound at start (a change needs a restart): the address it names.
    listen_host = deps.store.current.admin.listen.host
    refusal_log = RateLimit(per_interval=10, interval=60.0)
    failure_log = RateLimit(per_interval=10, interval=60.0)

    def refuse(request: web.Request, refusal: Refusal) -> web.Response:
        if refusal_log.allow():
            suppressed, refusal_log.suppressed = refusal_log.suppressed, 0
            log.warning(
                "admin request refused",
                extra={
                    "fields": {
                        "who": request.remote,
                        "call": f"{request.method} {request.path}",
                        "status": refusal.status,
                        "why": refusal.message,
                        "suppressed": suppressed,
                    }
                },
            )
        return error(refusal.status, refusal.message)

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        refusal = host_refusal(
            request.headers.getall("Host", []),
            deps.store.current.admin.allowed_hosts,
            listen_host,
            local_address(request),
        ) or site_refusal(request.method, request.headers)
        form = _canonical(request) in self_checked
        acts = request.method not in ("GET", "HEAD")
        if refusal is None and form and acts and deps.token is None:
            # Without a token a form acts for a loopback Host only (origin.form_host_refusal).
            refusal = form_host_refusal(request.headers.getall("Host", []))
        if refusal is not None:
            return refuse(request, refusal)
        needs = request.method not in ("GET", "HEAD") or _canonical(request) in token_for_get
        if (
            deps.token is not None
            and needs
            and not form
            and not bearer_ok(request.headers.get("Authorization"), deps.token)
        ):
            deps.failed_login(
                request.remote or "unknown", "api", f"{request.method} {request.path}"
            )
            resp = error(401, "this call needs Authorization: Bearer <admin token>")
            resp.headers["WWW-Authenticate"] = "Bearer"
            return resp
        if request.body_exists and not form and request.content_type != JSON_TYPE:
            # A browser sends text/plain, a form's types and multipart cross-site without a
            # preflight; application/json it never does.
            return error(415, f"admin request bodies must be {JSON_TYPE}")
        try:
            if request.body_exists:
                stopped = await read_body(request, deps.store.current.limits.body_idle_timeout)
                if stopped is not None:
                    return stopped
            return await handler(request)
        except web.HTTPException as exc:
            if exc.status >= 400:
                return error(exc.status, exc.reason)
            raise
        except ConnectionError:
            # The client left (a reset, or aiohttp's ClientConnectionResetError while the body
            # was read or the answer written): not a failure of the handler, nothing to log.
            request.protocol.force_close()
            return error(400, "the client closed the connection")
        except Exception:
            if failure_log.allow():
                suppressed, failure_log.suppressed = failure_log.suppressed, 0
                log.exception(
                    "admin call %s %s failed (%d such failures not logged before this one)",
                    request.method,
                    request.path,
                    suppressed,
                )
            return error(500, "the admin call failed; the sidecar's log has the traceback")

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if deps.life.draining:
            return web.json_response({"status": "draining"}, status=503)
        if not deps.life.ready:
            return web.json_response({"status": "starting"}, status=503)
        return web.json_response({"status": "ready"})

    async def metrics(request: web.Request) -> web.Response:
        # Imported at the first scrape: prometheus_client costs ~1.5 MB of RSS.
        from sidecar.telemetry.exposition import scrape

        body, content_type = scrape(deps.metrics, request.headers.get("Accept", ""))
        return web.Response(
            body=body,
            headers={"Content-Type": content_type, "X-Content-Type-Options": "nosniff"},
        )

    async def get_config(request: web.Request) -> web.Response:
        c = deps.store.current
        return web.json_response(
            {
                "version": c.sha256,
                "loaded_at": iso(deps.store.loaded.loaded_at),
                "source": c.source,
                "last_error": deps.store.last_error,
                "restart_required": deps.reloader.restart_required if deps.reloader else [],
                "routes": [route_json(r) for r in c.routes],
                "settings": settings_json(c),
            }
        )

    async def reload(request: web.Request) -> web.Response:
        if deps.reloader is None:
            return error(409, "this sidecar was not started from a file; nothing to reload")
        result = await deps.reloader.reload("admin")
        audit.warning(
            "config reload requested",
            extra={"fields": {"audit": "config.reload", "who": request.remote, "ok": result.ok}},
        )
        if not result.ok:
            return web.json_response(
                {
                    "error": "the new config is invalid; the last good config keeps serving",
                    "errors": result.errors,
                    "version": result.version,
                },
                status=422,
            )
        return web.json_response(
            {
                "version": result.version,
                "changed": result.changed,
                "restart_required": result.restart_required,
            }
        )

    async def get_kill(request: web.Request) -> web.Response:
        switches = deps.kill.active(deps.clock.monotonic())
        return web.json_response({"switches": [switch_json(s) for s in switches]})

    async def put_kill(request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            scope, ttl, reason = check_set(
                body.get("scope"),
                body.get("ttl"),
                body.get("reason"),
                lambda name: deps.store.current.route(name) is not None,
            )
        except BadRequest as exc:
            return error(400, str(exc))
        unknown = set(body) - {"scope", "ttl", "reason"}
        if unknown:
            return error(400, f"unknown keys: {', '.join(sorted(unknown))}")
        who = request.remote or "unknown"
        now, wall = deps.clock.monotonic(), deps.clock.wall()
        try:
            sw = await deps.kill.set_from_api(scope, ttl, reason, who, now, wall)
        except FleetUnavailable as exc:
            return error(503, f"{exc}; the fleet kill switch was not set (nothing changed)")
        audit_set(sw, ttl, "api")
        return web.json_response(switch_json(sw))

    async def delete_kill(request: web.Request) -> web.Response:
        scope = request.query.get("scope")
        if not scope:
            return error(400, "give the scope to lift: DELETE /killswitch?scope=global")
        now = deps.clock.monotonic()
        try:
            lifted = await deps.kill.lift_from_api(scope)
        except FleetUnavailable as exc:
            return error(503, f"{exc}; the fleet kill switch was not lifted (nothing changed)")
        if not lifted:
            in_file = deps.kill.file_switch(scope, now)
            if in_file is not None:
                return error(
                    409,
                    f"the {scope} switch comes from the policy file ({in_file.set_by}); "
                    "remove it there, or wait for its until",
                )
            return error(404, f"no active kill switch with scope {scope!r}")
        audit_lift(scope, request.remote or "unknown", "api")
        remaining = [switch_json(s) for s in deps.kill.active(now) if s.scope == scope]
        return web.json_response({"lifted": scope, "remaining": remaining})

    async def breakers(request: web.Request) -> web.Response:
        out = {
            f.name: {
                "state": f.breaker,
                "sequences": f.breaker_sequences,
                "failures": f.breaker_failures,
                "opened_at": iso(f.breaker_opened_at_wall),
                "budget": {"requests": f.budget_requests, "retries": f.budget_retries},
                "in_flight": f.in_flight,
            }
            for f in deps.figures.at(deps.clock.monotonic())
        }
        return web.json_response({"routes": out})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(deps.stats())

    async def not_found(request: web.Request) -> web.Response:
        """No route for this method and path: 405 with Allow when the path exists with other
        methods (RFC 9110 section 15.5.6: ``curl :15000/config/reload`` forgot -X POST, the
        endpoint is there), else 404."""
        allowed: set[str] = set()
        for resource in request.app.router.resources():
            if resource is not catch_all:
                allowed |= (await resource.resolve(request))[1]
        if allowed:
            resp = error(
                405, f"{request.path} takes {', '.join(sorted(allowed))}, not {request.method}"
            )
            resp.headers["Allow"] = ", ".join(sorted(allowed))
            return resp
        return error(404, f"no admin endpoint {request.method} {request.path}")

    app = web.Application(middlewares=[guard], client_max_size=MAX_ADMIN_BODY)
    app.on_response_prepare.append(secure_answer)
    r = app.router
    r.add_get("/healthz", healthz)
    r.add_get("/readyz", readyz)
    r.add_get("/metrics", metrics)
    r.add_get("/config", get_config)
    r.add_post("/config/reload", reload)
    r.add_get("/killswitch", get_kill)
    r.add_put("/killswitch", put_kill)
    r.add_delete("/killswitch", delete_kill)
    r.add_get("/breakers", breakers)
    r.add_get("/stats", stats)
    for method, path, handler, token_even_for_get in extra or []:
        res = r.add_route(method, path, handler)
        if token_even_for_get:
            token_for_get.add(res.resource.canonical if res.resource else path)
    for method, path, handler in forms or []:
        r.add_route(method, path, handler)
        self_checked.add(path)
    catch_all = r.add_route("*", "/{tail:.*}", not_found).resource
    return app


async def closing(request: web.Request, resp: web.Response) -> web.Response:
    """Send ``resp`` now and close the connection after it: the rest of the request's body is
    neither read nor lingered for (aiohttp would wait up to 10 s for it otherwise)."""
    resp.force_close()
    try:
        await resp.prepare(request)
        await resp.write_eof()
    finally:
        request.protocol.force_close()  # closes the transport once what was written is sent
    return resp


async def read_body(request: web.Request, idle: float) -> web.Response | None:
    """Read a request's whole body before its handler runs (``request.read()`` keeps it for the
    handler), or the answer that ends the request instead. An admin body is small (at most
    ``MAX_ADMIN_BODY``), so the whole read is bounded by ``limits.body_idle_timeout``: a client
    that stalls gets 408 and the connection is closed, as on the proxy listener."""
    too_large = f"admin request bodies are limited to {MAX_ADMIN_BODY} bytes"
    if request.content_length is not None and request.content_length > MAX_ADMIN_BODY:
        return await closing(request, error(413, too_large))
    try:
        async with asyncio.timeout(idle):
            await request.read()
    except TimeoutError:
        stalled = f"the request body did not arrive within {idle:g} s (body_idle_timeout)"
        return await closing(request, error(408, stalled))
    except web.HTTPRequestEntityTooLarge:
        return await closing(request, error(413, too_large))
    return None


async def _json_body(request: web.Request) -> dict[str, Any] | web.Response:
    if request.content_length is not None and request.content_length > MAX_ADMIN_BODY:
        return error(413, f"admin request bodies are limited to {MAX_ADMIN_BODY} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return error(413, f"admin request bodies are limited to {MAX_ADMIN_BODY} bytes")
    try:
        body = loads_json(raw)
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
        return error(400, f"the body is not valid JSON: {exc}")
    if not isinstance(body, dict):
        return error(400, "the body must be a JSON object")
    return body

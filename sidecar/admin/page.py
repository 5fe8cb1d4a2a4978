"""The status page on the admin listener: ``GET /`` (HTML, no JavaScript, refreshes itself),
``GET /status`` (the same figures as JSON), and the forms that act: set and lift a kill switch,
replay parked DLQ records.

A form is shown on its own page (``GET /ui/...``) that does not refresh, so nothing the
operator types is wiped; it posts to the same path, and a successful post redirects to the
status page (303, post/redirect/get) with a notice. How a post is authenticated is described
in ``formauth``: the token is typed into the form, never put in a URL or a page.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from sidecar.admin import render
from sidecar.admin.fmt import when
from sidecar.admin.formauth import FormRefused, Nonces, check_token
from sidecar.admin.killswitch import BadRequest, audit_lift, audit_set, check_set
from sidecar.admin.render import REFRESH_CHOICES, Notice, View
from sidecar.admin.server import SECURITY_HEADERS, FormRoute
from sidecar.admin.snapshot import (
    DEFAULT_WINDOW,
    WINDOWS,
    StatusSources,
    dlq_figures,
    switch_view,
    take,
)
from sidecar.fleet.connection import FleetUnavailable
from sidecar.jsonapi import ExtraRoute, error, whole_number

log = logging.getLogger("sidecar.admin")
MAX_NOTICES = 50
MAX_REPLAY = 1000
FORM_TYPE = "application/x-www-form-urlencoded"
# The forms' actions: each form page and the path it posts to; a nonce is bound to one.
SET_ACTION = "/ui/killswitch"
LIFT_ACTION = "/ui/killswitch/lift"
REPLAY_ACTION = "/ui/dlq/replay"
Form = dict[str, str]  # the fields of a posted form (the last value of a repeated one)


class ParkedReplayer(Protocol):
    """The DLQ's replayer as the page uses it (``sidecar.dlq.replay.Replayer``)."""

    async def replay_batch(
        self, route: str | None, status: str, limit: int, dry_run: bool
    ) -> dict[str, Any]: ...


@dataclass
class PageDeps:
    sources: StatusSources
    token: str | None
    replayer: Callable[[], ParkedReplayer | None]
    nonces: Nonces = field(default_factory=Nonces)
    # A refused token: (who, via, call); counted and logged (auth.FailedLogins).
    failed_login: Callable[[str, str, str], None] = lambda who, via, call: None
    notices: OrderedDict[int, Notice] = field(default_factory=OrderedDict)
    next_notice: int = 1

    def notice(self, ok: bool, text: str) -> int:
        nid = self.next_notice
        self.next_notice += 1
        self.notices[nid] = Notice(ok, text, self.sources.clock.wall())
        while len(self.notices) > MAX_NOTICES:
            self.notices.popitem(last=False)
        return nid


def html(text: str, status: int = 200) -> web.Response:
    return web.Response(
        text=text,
        status=status,
        content_type="text/html",
        charset="utf-8",
        headers={
            **SECURITY_HEADERS,
            "Content-Security-Policy": render.CSP,
            "Referrer-Policy": "same-origin",
        },
    )


def parse_view(request: web.Request) -> View:
    """Lenient: an unknown window or refresh falls back to the default."""
    window = request.query.get("window", DEFAULT_WINDOW)
    if window not in WINDOWS:
        window = DEFAULT_WINDOW
    asked = whole_number(request.query.get("refresh"))
    refresh = asked if asked in REFRESH_CHOICES else render.DEFAULT_REFRESH
    return View(window, refresh)


def page_routes(deps: PageDeps) -> tuple[list[ExtraRoute], list[FormRoute]]:
    src = deps.sources
    token_set = deps.token is not None

    def route_names() -> list[str]:
        return [r.name for r in src.store.current.routes]

    async def status_page(request: web.Request) -> web.Response:
        view = parse_view(request)
        st = await take(src, view.window)
        done = whole_number(request.query.get("done"))
        notice = deps.notices.get(done) if done is not None else None
        return html(render.status_page(st, view, notice, token_set))

    async def status_json(request: web.Request) -> web.Response:
        window = request.query.get("window", DEFAULT_WINDOW)
        if window not in WINDOWS:
            return error(400, f"window must be one of {', '.join(WINDOWS)}")
        return web.json_response((await take(src, window)).as_json())

    # -- set a kill switch ------------------------------------------------------------------

    def set_page(f: Form, message: str | None, status: int) -> web.Response:
        return html(
            render.set_form(
                route_names(),
                deps.nonces.issue(SET_ACTION, src.clock.wall()),
                token_set,
                scope=f.get("scope", "global"),
                ttl=f.get("ttl", "15m"),
                reason=f.get("reason", ""),
                message=message,
            ),
            status,
        )

    async def set_get(request: web.Request) -> web.Response:
        scope = request.query.get("scope", "global")
        return set_page({"scope": scope}, None, 200)

    async def set_post(request: web.Request) -> web.StreamResponse:
        form = await _accept(request, deps, SET_ACTION)
        if isinstance(form, FormRefused):
            return set_page({}, form.message, form.status)
        f, refused = form
        if refused is not None:
            return set_page(f, refused.message, refused.status)
        try:
            scope, ttl, reason = check_set(
                f.get("scope"),
                f.get("ttl"),
                f.get("reason"),
                lambda name: src.store.current.route(name) is not None,
            )
        except BadRequest as exc:
            return set_page(f, str(exc), 400)
        who, now, wall = request.remote or "unknown", src.clock.monotonic(), src.clock.wall()
        try:
            sw = await src.kill.set_from_api(scope, ttl, reason, who, now, wall)
        except FleetUnavailable as exc:
            return set_page(f, f"{exc}: nothing was set.", 503)
        audit_set(sw, ttl, "status-page")
        nid = deps.notice(
            True, f"Retries are off for {scope} until {when(sw.expires_at)}: {reason}"
        )
        raise web.HTTPSeeOther(f"/?done={nid}")

    # -- lift one ---------------------------------------------------------------------------

    def lift_page(scope: str, message: str | None, status: int) -> web.Response:
        now, wall = src.clock.monotonic(), src.clock.wall()
        found = [
            switch_view(s, wall)
            for s in src.kill.active(now)
            if s.scope == scope and s.source in ("admin", "fleet")
        ]
        if not found and status == 200:
            status = 404
            in_file = src.kill.file_switch(scope, now)
            if in_file is not None:
                message = (
                    f"The {scope} switch comes from the policy file ({in_file.set_by}): "
                    "remove it there to lift it on every pod."
                )
        return html(
            render.lift_form(
                found[0] if found else None,
                scope,
                deps.nonces.issue(LIFT_ACTION, wall),
                token_set,
                message,
            ),
            status,
        )

    async def lift_get(request: web.Request) -> web.Response:
        return lift_page(request.query.get("scope", ""), None, 200)

    async def lift_post(request: web.Request) -> web.StreamResponse:
        form = await _accept(request, deps, LIFT_ACTION)
        if isinstance(form, FormRefused):
            return lift_page("", form.message, form.status)
        f, refused = form
        scope = f.get("scope", "")
        if refused is not None:
            return lift_page(scope, refused.message, refused.status)
        try:
            lifted = await src.kill.lift_from_api(scope)
        except FleetUnavailable as exc:
            return lift_page(scope, f"{exc}: nothing was lifted.", 503)
        if not lifted:
            return lift_page(scope, f"No admin kill switch is active for {scope}.", 404)
        audit_lift(scope, request.remote or "unknown", "status-page")
        nid = deps.notice(True, f"Lifted the {scope} kill switch: retries resume.")
        raise web.HTTPSeeOther(f"/?done={nid}")

    # -- replay parked DLQ records ----------------------------------------------------------

    async def replay_page(g: Form, message: str | None, status: int) -> web.Response:
        figures = await dlq_figures(src)
        names = route_names()
        routes = [(n, int(figures.get(n, {}).get("parked", 0))) for n in names]
        routes += [(n, int(d.get("parked", 0))) for n, d in figures.items() if n not in names]
        return html(
            render.replay_form(
                routes,
                deps.nonces.issue(REPLAY_ACTION, src.clock.wall()),
                token_set,
                route=g.get("route", ""),
                limit=g.get("limit", "100"),
                dry_run=bool(g.get("dry_run")),
                message=message,
            ),
            status,
        )

    async def replay_get(request: web.Request) -> web.Response:
        route = request.query.get("route", "")
        return await replay_page({"route": route}, None, 200)

    async def replay_post(request: web.Request) -> web.StreamResponse:
        form = await _accept(request, deps, REPLAY_ACTION)
        if isinstance(form, FormRefused):
            return await replay_page({}, form.message, form.status)
        f, refused = form
        if refused is not None:
            return await replay_page(f, refused.message, refused.status)
        replayer = deps.replayer()
        if replayer is None:
            return await replay_page(f, "No DLQ is open on this sidecar.", 503)
        route = f.get("route", "")
        limit_raw = f.get("limit", "")
        if not route:
            return await replay_page(f, "Choose a route.", 400)
        limit = whole_number(limit_raw)
        if limit is None or not 1 <= limit <= MAX_REPLAY:
            return await replay_page(f, f"The limit must be a number from 1 to {MAX_REPLAY}.", 400)
        dry_run = bool(f.get("dry_run"))
        try:
            result = await replayer.replay_batch(route, "parked", limit, dry_run)
        except Exception as exc:  # the store's errors (DlqError) say what went wrong
            log.warning("replay from the status page failed: %s", exc)
            return await replay_page(f, f"The DLQ could not be read: {exc}", 503)
        nid = deps.notice(True, _replay_summary(route, result))
        raise web.HTTPSeeOther(f"/?done={nid}")

    gets: list[ExtraRoute] = [
        ("GET", "/", status_page, False),
        ("GET", "/status", status_json, False),
        ("GET", SET_ACTION, set_get, False),
        ("GET", LIFT_ACTION, lift_get, False),
        ("GET", REPLAY_ACTION, replay_get, False),
    ]
    posts: list[FormRoute] = [
        ("POST", SET_ACTION, set_post),
        ("POST", LIFT_ACTION, lift_post),
        ("POST", REPLAY_ACTION, replay_post),
    ]
    return gets, posts


async def _accept(
    request: web.Request, deps: PageDeps, action: str
) -> FormRefused | tuple[Form, FormRefused | None]:
    """Body type, nonce (for this form's action) and token of a form post; the admin guard
    has judged Host and origin already. A refusal before the form is read comes back alone;
    one after it comes back with the form, to fill it in again."""
    if request.content_type != FORM_TYPE:
        return FormRefused(415, f"a form post must be {FORM_TYPE}")
    try:
        raw = await request.post()
    except ValueError:  # UnicodeDecodeError: the form's bytes are not UTF-8
        return FormRefused(400, "the form is not UTF-8")
    form: Form = {k: v for k, v in raw.items() if isinstance(v, str)}
    try:
        deps.nonces.use(action, form.get("nonce", ""), deps.sources.clock.wall())
        check_token(form.get("token"), deps.token)
    except FormRefused as exc:
        if exc.status == 401:
            deps.failed_login(request.remote or "unknown", "status-page", f"POST {action}")
        return form, exc
    return form, None


def _replay_summary(route: str, result: dict[str, object]) -> str:
    if result.get("dry_run"):
        ids = result.get("would_replay") or []
        assert isinstance(ids, list)
        shown = ", ".join(str(i) for i in ids[:10]) + (" …" if len(ids) > 10 else "")
        listed = f": {shown}" if ids else ""
        return f"Dry run on {route}: {len(ids)} parked records would be replayed{listed}."
    replayed = result.get("replayed") or []
    assert isinstance(replayed, list)
    counts: dict[str, int] = {}
    for r in replayed:
        key = str(r.get("status") or "error") if isinstance(r, dict) else "error"
        counts[key] = counts.get(key, 0) + 1
    detail = ", ".join(f"{n} {k}" for k, n in sorted(counts.items())) or "nothing to replay"
    return f"Replayed {len(replayed)} parked records of {route}: {detail}."

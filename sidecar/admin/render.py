"""HTML for the status page and its forms: pure functions of a ``Status``, no JavaScript.

Every dynamic string goes through ``html.escape``. The one stylesheet is static, so the
Content-Security-Policy can allow it by its hash and nothing else (no scripts, no inline styles).
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from html import escape
from urllib.parse import urlencode

from sidecar.admin.fmt import age, figure_text, pct, rate, size, success_class, tls_items, when
from sidecar.admin.snapshot import WINDOWS, FleetUse, RouteStatus, Status, SwitchView
from sidecar.engine.figures import COLUMNS

REFRESH_CHOICES = (0, 2, 5, 10, 30, 60)
DEFAULT_REFRESH = 5

STYLE = """
:root { color-scheme: light; --ok: #1a7f37; --warn: #9a6700; --bad: #cf222e; --mute: #57606a;
  --line: #d0d7de; --bg2: #f6f8fa; }
* { box-sizing: border-box; }
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 0;
  color: #1f2328; background: #fff; }
header { padding: 12px 20px; border-bottom: 1px solid var(--line); display: flex; gap: 24px;
  align-items: baseline; flex-wrap: wrap; background: var(--bg2); }
header h1 { font-size: 18px; margin: 0; }
header .ctl a, header .ctl strong { margin-right: 6px; }
main { padding: 12px 20px 32px; }
h2 { font-size: 15px; margin: 22px 0 8px; }
table { border-collapse: collapse; width: 100%; }
th, td { border-bottom: 1px solid var(--line); padding: 6px 8px; text-align: left;
  vertical-align: top; }
th { background: var(--bg2); font-weight: 600; white-space: nowrap; }
th small { font-weight: normal; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
small, .mute { color: var(--mute); }
.ok { color: var(--ok); } .warn { color: var(--warn); } .bad { color: var(--bad); }
.badge { display: inline-block; padding: 0 7px; border-radius: 10px; font-weight: 600;
  font-size: 12px; border: 1px solid currentColor; }
.fates span { display: inline-block; margin: 0 8px 2px 0; white-space: nowrap; }
.banner { padding: 10px 14px; margin: 12px 0; border-radius: 6px; border: 1px solid; }
.banner.warn { background: #fff8c5; border-color: #d4a72c; color: #4d2d00; }
.banner.bad { background: #ffebe9; border-color: #ff8182; color: #82071e; }
.banner.ok { background: #dafbe1; border-color: #4ac26b; color: #044f1e; }
dl.grid { display: grid; grid-template-columns: max-content 1fr max-content 1fr; gap: 4px 16px;
  margin: 0; }
dl.grid dt { color: var(--mute); } dl.grid dd { margin: 0; }
form.act { max-width: 560px; }
form.act label { display: block; margin: 12px 0 4px; font-weight: 600; }
form.act input, form.act select { width: 100%; padding: 6px 8px; font: inherit; }
form.act input[type=checkbox] { width: auto; }
form.act button { margin-top: 16px; padding: 7px 16px; font: inherit; font-weight: 600; }
code { font-size: 12px; }
"""
STYLE_HASH = "sha256-" + base64.b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
CSP = (
    f"default-src 'none'; style-src '{STYLE_HASH}'; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)


@dataclass(frozen=True, slots=True)
class View:
    """How the operator is looking at the page: the window and the refresh period."""

    window: str = "1m"
    refresh: int = DEFAULT_REFRESH

    def query(self, **extra: str) -> str:
        q = {}
        if self.window != "1m":
            q["window"] = self.window
        if self.refresh != DEFAULT_REFRESH:
            q["refresh"] = str(self.refresh)
        q.update(extra)
        return "?" + urlencode(q) if q else ""


@dataclass(frozen=True, slots=True)
class Notice:
    ok: bool
    text: str
    at: float


BREAKER_CLASS = {"closed": "ok", "half-open": "warn", "open": "bad"}
GOOD_FATES = {"success"}
NEUTRAL_FATES = {"not-retryable", "edge-owned", "non-idempotent", "body-too-large"}


# -- the page ---------------------------------------------------------------------------------


def page(title: str, body: str, refresh: int = 0) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (
        "<!doctype html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"{meta}<title>{escape(title)}</title><style>{STYLE}</style></head>"
        f"<body>{body}</body></html>\n"
    )


def status_page(st: Status, view: View, notice: Notice | None, token_set: bool) -> str:
    p = st.process
    parts = [_header(st, view)]
    parts.append("<main>")
    if notice is not None:
        cls = "ok" if notice.ok else "bad"
        parts.append(
            f'<div class="banner {cls}" id="notice">{escape(notice.text)} '
            f"<small>({escape(when(notice.at))})</small></div>"
        )
    glob = [s for s in st.switches if s.scope == "global"]
    for s in glob:
        parts.append(
            '<div class="banner warn" id="global-switch"><strong>Retries are off for every '
            f"route</strong> (global kill switch, {escape(s.source)}): {escape(s.reason)} — "
            f"ends in {age(s.expires_in)}.</div>"
        )
    if not p.last_reload_ok:
        parts.append(
            '<div class="banner bad" id="reload-failed"><strong>The last config reload failed'
            "</strong>; the last good config keeps serving: "
            f"<code>{escape(p.last_error or '')}</code></div>"
        )
    if p.draining:
        parts.append('<div class="banner warn">Draining: this sidecar is shutting down.</div>')
    parts.append(_routes_table(st, view))
    parts.append(_switches_table(st, view))
    parts.append(_process(st))
    parts.append(_legend(st, token_set))
    parts.append("</main>")
    return page(f"retry-sidecar {p.name}", "".join(parts), view.refresh)


def _header(st: Status, view: View) -> str:
    windows = " ".join(
        f"<strong>{w}</strong>"
        if w == view.window
        else f'<a href="/{View(w, view.refresh).query()}">{w}</a>'
        for w in WINDOWS
    )
    if view.refresh:
        refresh = (
            f"every {view.refresh}s · "
            f'<a href="/{View(view.window, 0).query()}" id="pause">pause</a>'
        )
    else:
        refresh = (
            f'paused · <a href="/{View(view.window, DEFAULT_REFRESH).query()}" '
            'id="resume">resume</a>'
        )
    return (
        f"<header><h1>retry-sidecar <span class=mute>{escape(st.process.name)}</span></h1>"
        f'<span class="ctl">window: {windows}</span>'
        f'<span class="ctl">refresh: {refresh}</span>'
        f'<span class="mute">as of {escape(when(st.at))} · figures over the last '
        f"{age(st.window_seconds)}</span></header>"
    )


def _fates(r: RouteStatus) -> str:
    if not r.fates:
        return '<span class="mute">no requests</span>'
    out = []
    for fate, n in r.fates.items():
        cls = "ok" if fate in GOOD_FATES else "mute" if fate in NEUTRAL_FATES else "bad"
        out.append(f'<span class="{cls}">{escape(fate)} {n}</span>')
    return '<div class="fates">' + "".join(out) + "</div>"


def _breaker(r: RouteStatus) -> str:
    f = r.figures
    cls = BREAKER_CLASS.get(f.breaker, "mute")
    out = f'<span class="badge {cls}">{escape(f.breaker)}</span>'
    if f.next_probe_in is not None:
        out += f"<br><small>probe in {age(f.next_probe_in)}</small>"
    elif f.breaker == "half-open":
        out += "<br><small>probing</small>"
    else:
        out += f"<br><small>{f.breaker_failures}/{f.breaker_sequences} failed</small>"
    return out


def _figure_cells(r: RouteStatus) -> str:
    """The figures declared with a column of their own (``engine/figures.py``)."""
    values = r.figures.as_json()
    return "".join(
        f'<td class="num">{escape(figure_text(values[name]) or "—")}</td>' for name, _ in COLUMNS
    )


def _switch_cell(r: RouteStatus) -> str:
    if not r.switches:
        return '<span class="mute">—</span>'
    out = []
    for s in r.switches:
        out.append(
            f'<span class="badge warn">retries off</span> {escape(s.reason)}'
            f"<br><small>{escape(s.scope)} · {escape(s.source)} · ends in "
            f"{age(s.expires_in)}</small>"
        )
    return "<br>".join(out)


def _dlq_cell(r: RouteStatus) -> str:
    if r.dlq_pending is None:
        return (
            '<span class="mute">off</span>'
            if not r.dlq_enabled
            else '<span class="bad">unavailable</span>'
        )
    if not r.dlq_enabled and not (r.dlq_pending or r.dlq_parked):
        return '<span class="mute">off</span>'
    pending_cls = "warn" if r.dlq_pending else "mute"
    parked_cls = "bad" if r.dlq_parked else "mute"
    out = (
        f'<span class="{pending_cls}">{r.dlq_pending} pending</span> · '
        f'<span class="{parked_cls}">{r.dlq_parked} parked</span>'
    )
    oldest = [
        f"{label} {age(v)}"
        for label, v in (("pending", r.dlq_oldest_pending_age), ("parked", r.dlq_oldest_parked_age))
        if v is not None
    ]
    if oldest:
        out += f"<br><small>oldest: {', '.join(oldest)}</small>"
    return out


def _idempotency(r: RouteStatus) -> str:
    """Guarded writes since start, under the route's name (idempotency enabled only)."""
    if r.idempotency is None:
        return ""
    counts = ", ".join(f"{escape(k)} {n}" for k, n in r.idempotency.items()) or "none yet"
    return f'<br><small class="idem">keys: {counts}</small>'


def _actions(r: RouteStatus) -> str:
    links = []
    scope = f"route:{r.name}"
    if any(s.scope == scope and s.source == "admin" for s in r.switches):
        links.append(f'<a href="/ui/killswitch/lift?{urlencode({"scope": scope})}">lift switch</a>')
    elif not r.switches:
        links.append(
            f'<a href="/ui/killswitch?{urlencode({"scope": scope})}">switch off retries</a>'
        )
    if r.dlq_parked:
        links.append(f'<a href="/ui/dlq/replay?{urlencode({"route": r.name})}">replay parked</a>')
    return "<br>".join(links) or '<span class="mute">—</span>'


def _routes_table(st: Status, view: View) -> str:
    rows = []
    for r in st.routes:
        f = r.figures
        sc = success_class(r.success_ratio)
        rpr = "—" if r.retries_per_request is None else f"{r.retries_per_request:.2f}"
        rows.append(
            f'<tr id="route-{escape(r.name)}">'
            f'<th scope="row">{escape(r.name)}<br><small>{escape(r.upstream)}</small>'
            f"{_idempotency(r)}</th>"
            f'<td class="num">{rate(r.rps)}<br><small>{r.requests} req</small></td>'
            f'<td class="num {sc}">{pct(r.success_ratio)}</td>'
            f'<td class="num">{rpr}<br><small>max {r.attempts_limit - 1}</small></td>'
            f"<td>{_fates(r)}</td>"
            f'<td class="num">{f.budget_left}<br><small>{f.budget_retries} used / '
            f"{age(f.budget_window)}</small></td>"
            f"<td>{_breaker(r)}</td>"
            f'<td class="num">{f.in_flight}<br><small>of {f.max_concurrent}</small></td>'
            f"<td>{_switch_cell(r)}</td>"
            f"<td>{_dlq_cell(r)}</td>" + _figure_cells(r) + f"<td>{_actions(r)}</td></tr>"
        )
    return (
        '<h2>Routes</h2><table id="routes"><thead><tr>'
        '<th>Route</th><th class="num">Req/s</th><th class="num">Success</th>'
        '<th class="num">Retries/req</th><th>Fates</th><th class="num">Budget left</th>'
        '<th>Breaker</th><th class="num">In flight</th><th>Kill switch</th><th>DLQ</th>'
        + "".join(f'<th class="num">{escape(title)}</th>' for _, title in COLUMNS)
        + "<th>Act</th></tr></thead><tbody>"
        + "".join(rows)
        + "</tbody></table>"
    )


def _switches_table(st: Status, view: View) -> str:
    if not st.switches:
        return (
            '<h2>Kill switches</h2><p id="switches" class="mute">None active. '
            '<a href="/ui/killswitch?scope=global">Switch off retries everywhere…</a></p>'
        )
    rows = []
    for s in st.switches:
        if s.source in ("admin", "fleet"):
            action = f'<a href="/ui/killswitch/lift?{urlencode({"scope": s.scope})}">lift</a>'
        else:
            action = '<span class="mute">edit the policy file</span>'
        rows.append(
            f"<tr><td>{escape(s.scope)}</td><td>{escape(s.source)}</td>"
            f"<td>{escape(s.reason)}</td><td>{escape(s.set_by)}"
            f"{'' if s.set_on is None else ' on ' + escape(s.set_on)}</td>"
            f"<td>{escape(when(s.set_at))}</td>"
            f'<td class="num">{escape(when(s.expires_at))}<br><small>in '
            f"{age(s.expires_in)}</small></td><td>{action}</td></tr>"
        )
    return (
        '<h2>Kill switches</h2><table id="switches"><thead><tr><th>Scope</th><th>Source</th>'
        "<th>Reason</th><th>Set by</th><th>Set at</th><th class=num>Expires</th><th></th>"
        "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
        '<p><a href="/ui/killswitch?scope=global">Set another…</a></p>'
    )


def _process(st: Status) -> str:
    p = st.process
    reload = (
        f'<span class="ok">ok</span> at {escape(when(p.last_reload_at))}'
        if p.last_reload_ok
        else f'<span class="bad">failed</span>: <code>{escape(p.last_error or "")}</code>'
    )
    restart = (
        '<span class="warn">' + escape("; ".join(p.restart_required)) + "</span>"
        if p.restart_required
        else '<span class="mute">nothing</span>'
    )
    conns = "—" if p.client_connections is None else str(p.client_connections)
    items = [
        ("Uptime", f"{age(p.uptime)} <small>(since {escape(when(p.started_at))})</small>"),
        ("State", "draining" if p.draining else "ready" if p.ready else "starting"),
        ("Config", f"<code>{escape(p.config_version[:12])}</code> from {escape(p.config_source)}"),
        ("Loaded at", escape(when(p.loaded_at))),
        ("Last reload", reload),
        ("Needs restart", restart),
        ("RSS", size(p.rss_bytes)),
        ("Open files", str(p.open_fds)),
        ("Client connections", conns),
        (
            "Upstream connections",
            f"{p.upstream_connections} <small>({p.upstream_idle} idle)</small>",
        ),
        ("DLQ", f"{escape(p.dlq)} <small>{escape(p.dlq_path)}</small>"),
    ]
    for label, slug, said in (
        ("DLQ", "dlq", p.dlq_warning),
        ("Idempotency", "idempotency", p.idempotency_warning),
    ):
        if said is not None:
            span = f'<span class="bad" id="{slug}-warning">{escape(said)}</span>'
            items.append((f"{label} warning", span))
    items.extend([*(_fleet(use, f) for use, f in p.fleet.items()), *tls_items(p.tls_listener)])
    cells = "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in items)
    return f'<h2>Process</h2><dl class="grid" id="process">{cells}</dl>'


def _fleet(use: str, f: FleetUse) -> tuple[str, str]:
    """One use of the fleet's Redis: its state, and while unreachable why and what it means."""
    name, state = f"Fleet Redis: {escape(use)}", f'id="fleet-{escape(use)}">{escape(f.state)}'
    if f.state == "connected":
        return name, f'<span class="ok" {state}</span>'
    why = f"{escape(f.error)}; " if f.error else ""
    means = f"<small>({why}{escape(f.while_unreachable)})</small>"
    return name, f'<span class="bad" {state}</span> {means}'


def _legend(st: Status, token_set: bool) -> str:
    auth = (
        "Actions ask for the admin token in a password field of their form; it is sent "
        "only in that form's body."
        if token_set
        else "No admin token is configured (loopback only): actions need no token."
    )
    return (
        '<h2>Reading it</h2><p class="mute">Req/s, success and retries/req cover the window '
        "above. Success is the share of requests whose fate is <code>success</code> (an answer "
        "below 400); a 4xx passed through counts as <code>not-retryable</code>. Budget left is "
        "how many retries the retry budget allows right now. In flight counts the requests "
        "holding a slot of the route's bulkhead (going to, or coming back from, the upstream). "
        f'{auth} The same figures as JSON: <a href="/status">/status</a>; metrics: '
        '<a href="/metrics">/metrics</a>.</p>'
    )


# -- the forms --------------------------------------------------------------------------------


def _token_field(token_set: bool) -> str:
    if not token_set:
        return ""
    return (
        '<label for="token">Admin token</label>'
        '<input type="password" id="token" name="token" required autocomplete="off">'
    )


def _form_error(message: str | None) -> str:
    return f'<div class="banner bad" id="form-error">{escape(message)}</div>' if message else ""


def _form_page(title: str, inner: str) -> str:
    body = (
        f'<header><h1>{escape(title)}</h1><a href="/">back to the status page</a></header>'
        f"<main>{inner}</main>"
    )
    return page(title, body)


def set_form(
    routes: list[str],
    nonce: str,
    token_set: bool,
    scope: str = "global",
    ttl: str = "15m",
    reason: str = "",
    *,
    message: str | None = None,
) -> str:
    options = ["global", *[f"route:{n}" for n in routes]]
    opts = "".join(
        f'<option value="{escape(o)}"{" selected" if o == scope else ""}>{escape(o)}</option>'
        for o in options
    )
    inner = (
        _form_error(message) + "<p>From the next request on, the scope makes exactly one attempt "
        "(<code>x-retry-fate: kill-switch</code> when a retry was wanted). The switch ends by "
        "itself after the TTL, and it does not survive a restart: to reach every pod and "
        "outlive restarts, add it to the policy file's <code>killswitches:</code>.</p>"
        '<form class="act" method="post" action="/ui/killswitch" id="set-form">'
        f'<input type="hidden" name="nonce" value="{escape(nonce)}">'
        f'<label for="scope">Scope</label><select id="scope" name="scope">{opts}</select>'
        '<label for="ttl">For how long (at most 24h)</label>'
        f'<input id="ttl" name="ttl" value="{escape(ttl)}" required>'
        '<label for="reason">Reason (shown to everyone, logged)</label>'
        f'<input id="reason" name="reason" value="{escape(reason)}" required maxlength="1000">'
        f"{_token_field(token_set)}"
        '<button type="submit">Switch off retries</button></form>'
    )
    return _form_page("Switch off retries", inner)


def lift_form(
    switch: SwitchView | None, scope: str, nonce: str, token_set: bool, message: str | None = None
) -> str:
    if switch is None:
        inner = _form_error(message) + (
            f"<p>No kill switch set through the admin API is active for "
            f"<code>{escape(scope)}</code>.</p>"
        )
        return _form_page("Lift a kill switch", inner)
    inner = (
        _form_error(message)
        + f"<p>Lift <code>{escape(switch.scope)}</code>: “{escape(switch.reason)}”, set by "
        f"{escape(switch.set_by)}, ends in {age(switch.expires_in)}. Retries resume from the "
        "next request on.</p>"
        '<form class="act" method="post" action="/ui/killswitch/lift" id="lift-form">'
        f'<input type="hidden" name="nonce" value="{escape(nonce)}">'
        f'<input type="hidden" name="scope" value="{escape(switch.scope)}">'
        f"{_token_field(token_set)}"
        '<button type="submit">Lift it</button></form>'
    )
    return _form_page("Lift a kill switch", inner)


def replay_form(
    routes: list[tuple[str, int]],
    nonce: str,
    token_set: bool,
    route: str = "",
    limit: str = "100",
    dry_run: bool = False,
    *,
    message: str | None = None,
) -> str:
    opts = "".join(
        f'<option value="{escape(n)}"{" selected" if n == route else ""}>{escape(n)} '
        f"({parked} parked)</option>"
        for n, parked in routes
    )
    inner = (
        _form_error(message)
        + "<p>Parked records are sent again through the route's current policy, oldest "
        "first, with their <code>Idempotency-Key</code>; the answer decides their new status. "
        "Delivery is at least once: the upstream must honour the key.</p>"
        '<form class="act" method="post" action="/ui/dlq/replay" id="replay-form">'
        f'<input type="hidden" name="nonce" value="{escape(nonce)}">'
        f'<label for="route">Route</label><select id="route" name="route">{opts}</select>'
        '<label for="limit">At most this many records (1 to 1000)</label>'
        f'<input id="limit" name="limit" value="{escape(limit)}" required>'
        '<label><input type="checkbox" name="dry_run" value="1"'
        f"{' checked' if dry_run else ''}> Dry run: only list what would be replayed</label>"
        f"{_token_field(token_set)}"
        '<button type="submit">Replay parked records</button></form>'
    )
    return _form_page("Replay parked DLQ records", inner)

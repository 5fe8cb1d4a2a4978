"""The ``status`` and ``killswitch`` verbs: the status page's picture as a terminal table (in
the manner of ``linkerd viz stat``) and the kill switch, against a running sidecar.

Everything they print that came from the server (reasons, route names, errors) goes through
``fmt.printable``: a kill-switch reason must not clear the operator's screen."""

from __future__ import annotations

import sys
from typing import Any, TextIO
from urllib.parse import quote, urlencode

from sidecar.admin.client import AdminTarget, call
from sidecar.admin.fmt import age, figure_text, pct, printable, printable_json, rate, size
from sidecar.engine.figures import COLUMNS


def table(rows: list[list[str]], out: TextIO) -> None:
    """Left-aligned columns two spaces apart; the last column is not padded. Cells are
    escaped first (``printable``), so the columns line up with what the terminal shows."""
    if not rows:
        return
    rows = [[printable(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        cells = [c.ljust(w) for c, w in zip(r, widths, strict=False)] + [r[-1]]
        out.write("  ".join(cells).rstrip() + "\n")


def _dash(s: str) -> str:
    return s.replace("—", "-")


def call_admin(
    target: AdminTarget, method: str, path: str, body: Any = None, timeout: float = 5.0
) -> tuple[int, Any]:
    """An admin call; an admin API that cannot be reached ends the verb with one line on
    stderr and exit 1 (never a traceback: these verbs are typed during an incident)."""
    try:
        return call(target, method, path, body, timeout)
    except OSError as exc:
        reason = getattr(exc, "reason", exc)
        raise SystemExit(
            printable(f"error: cannot reach the admin API at {target.base}: {reason}")
        ) from None


def fail(status: int, body: Any) -> int:
    msg = body.get("error") if isinstance(body, dict) else body
    print(printable(f"error: {status}: {msg}"), file=sys.stderr)
    return 1


def replay_verdict(body: Any) -> int:
    """``dlq replay``'s exit status: 0 when every record replayed was delivered (the upstream
    answered below 400), else 1 with one line on stderr per record that was not, saying what
    the upstream answered (503, or no answer and why) and where the record is now."""
    outcomes = body.get("replayed", [body]) if isinstance(body, dict) else []
    missed = [o for o in outcomes if isinstance(o, dict) and o.get("status") != "delivered"]
    for o in missed:
        got = o.get("http_status")
        answer = f"the upstream answered {got}" if got is not None else "no answer"
        print(
            printable(
                f"error: replay of {o.get('id')} not delivered: {answer} "
                f"(fate {o.get('fate')}); the record is {o.get('status')}"
            ),
            file=sys.stderr,
        )
    return 1 if missed else 0


def status_rows(st: dict[str, Any]) -> list[list[str]]:
    rows = [
        [
            "ROUTE",
            "REQ/S",
            "SUCCESS",
            "RETRIES/REQ",
            "BREAKER",
            "BUDGET",
            "IN-FLIGHT",
            "KILL-SWITCH",
            "DLQ PEND/PARK",
            "OLDEST",
            *(title.upper() for _, title in COLUMNS),
            "KEYS",
            "FATES",
        ]
    ]
    for r in st["routes"]:
        breaker = r["breaker"]
        if r["next_probe_in"] is not None:
            breaker += f" (probe {age(r['next_probe_in'])})"
        switches = ",".join(f"{s['source']} {age(s['expires_in'])}" for s in r["switches"])
        if r["dlq_pending"] is None:
            dlq, oldest = ("off", "-") if not r["dlq_enabled"] else ("unavailable", "-")
        else:
            dlq = f"{r['dlq_pending']}/{r['dlq_parked']}"
            ages = [a for a in (r["dlq_oldest_pending_age"], r["dlq_oldest_parked_age"]) if a]
            oldest = age(max(ages)) if ages else "-"
        rpr = r["retries_per_request"]
        rows.append(
            [
                r["name"],
                rate(r["rps"]),
                _dash(pct(r["success_ratio"])),
                "-" if rpr is None else f"{rpr:.2f}",
                breaker,
                str(r["budget_left"]),
                f"{r['in_flight']}/{r['max_concurrent']}",
                switches or "-",
                dlq,
                oldest,
                *(figure_text(r.get(name)) or "-" for name, _ in COLUMNS),
                _keys(r.get("idempotency")),
                ", ".join(f"{f} {n}" for f, n in r["fates"].items()) or "-",
            ]
        )
    return rows


def _keys(counts: dict[str, int] | None) -> str:
    """Guarded writes by result since start; "off" when the route does not enable them."""
    if counts is None:
        return "off"
    return ", ".join(f"{k} {n}" for k, n in counts.items()) or "-"


def fleet_line(uses: dict[str, dict[str, Any]]) -> str:
    """Each use of the fleet's Redis and its state; why, and what it means, while unreachable."""
    said = []
    for use, f in uses.items():
        why = f"{f['error']}; " if f["error"] else ""
        more = "" if f["state"] == "connected" else f" ({why}{f['while_unreachable']})"
        said.append(f"{use} {f['state']}{more}")
    return ", ".join(said)


def print_status(st: dict[str, Any], out: TextIO) -> None:
    p = st["process"]
    reload = "ok" if p["last_reload_ok"] else f"FAILED: {p['last_error']}"
    conns = "-" if p["client_connections"] is None else p["client_connections"]
    head = [
        p["name"],
        "DRAINING" if p["draining"] else "ready" if p["ready"] else "starting",
        f"up {age(p['uptime'])}",
        f"config {p['config_version'][:12]} (last reload {reload})",
        f"rss {size(p['rss_bytes'])}",
        f"client connections {conns}",
        f"dlq {p['dlq']}",
        f"window {st['window']} (covers {age(st['window_seconds'])})",
    ]
    out.write(printable("  ".join(head)) + "\n")
    if p.get("dlq_warning"):
        out.write(printable("dlq warning: " + p["dlq_warning"]) + "\n")
    if p.get("idempotency_warning"):
        out.write(printable("idempotency warning: " + p["idempotency_warning"]) + "\n")
    if p["fleet"]:
        out.write(printable("fleet redis: " + fleet_line(p["fleet"])) + "\n")
    if p["restart_required"]:
        out.write(printable("needs a restart: " + "; ".join(p["restart_required"])) + "\n")
    out.write("\n")
    table(status_rows(st), out)
    if st["switches"]:
        out.write("\n")
        print_switches(st["switches"], out)


def print_switches(switches: list[dict[str, Any]], out: TextIO) -> None:
    rows = [["SCOPE", "SOURCE", "EXPIRES", "SET-BY", "REASON"]]
    for s in switches:
        expires = s["expires_at"] if isinstance(s["expires_at"], str) else ""
        if "expires_in" in s:
            expires = f"in {age(s['expires_in'])}"
        rows.append([s["scope"], s.get("source", "admin"), expires, s["set_by"], s["reason"]])
    table(rows, out)


def cmd_status(target: AdminTarget, window: str, as_json: bool) -> int:
    status, body = call_admin(target, "GET", "/status?" + urlencode({"window": window}))
    if status != 200:
        return fail(status, body)
    if as_json:
        print(printable_json(body))
    else:
        print_status(body, sys.stdout)
    return 0


def cmd_killswitch(
    target: AdminTarget,
    verb: str,
    scope: str | None,
    ttl: str | None,
    reason: str | None,
    as_json: bool,
) -> int:
    if verb == "list":
        status, body = call_admin(target, "GET", "/killswitch")
        if status != 200:
            return fail(status, body)
        if as_json:
            print(printable_json(body))
        elif not body["switches"]:
            print("no kill switch is active")
        else:
            print_switches(body["switches"], sys.stdout)
        return 0
    assert scope is not None
    if verb == "set":
        status, body = call_admin(
            target, "PUT", "/killswitch", {"scope": scope, "ttl": ttl, "reason": reason}
        )
        if status != 200:
            return fail(status, body)
        print(
            printable(
                f"retries off for {body['scope']} until {body['expires_at']}: {body['reason']}"
            )
        )
        return 0
    status, body = call_admin(target, "DELETE", "/killswitch?" + urlencode({"scope": scope}))
    if status != 200:
        return fail(status, body)
    print(printable(f"lifted {body['lifted']}"))
    for s in body.get("remaining", []):
        print(
            printable(f"still active from the {s['source']}: {s['scope']} until {s['expires_at']}")
        )
    return 0


def cmd_idempotency(
    target: AdminTarget, verb: str, key: str, scope: str | None, *, route: str | None = None
) -> int:
    """``idempotency show KEY`` prints what is kept under it; ``forget KEY`` deletes it (the
    next request with it runs as a first one)."""
    path = "/idempotency/" + quote(key, safe="")
    query = {k: v for k, v in (("scope", scope), ("route", route)) if v}
    if query:
        path += "?" + urlencode(query)
    status, body = call_admin(target, "GET" if verb == "show" else "DELETE", path)
    if status != 200:
        return fail(status, body)
    print(printable_json(body))
    return 0

"""The DLQ's admin endpoints: list, show, replay, purge (docs/dlq.md).

Every one of them needs the admin token when one is set, reads included: the list shows
targets with their query strings and Idempotency-Keys, and a record holds its body.
They exist even while no DLQ is open (a route may enable it by a reload) and answer 503 then.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sidecar.dlq.errors import ClaimRefused, DlqError, RecordBusy, RecordNotFound
from sidecar.jsonapi import ExtraRoute, error, iso, loads_json, whole_number

if TYPE_CHECKING:
    # The endpoints exist before any DLQ opens; the store and replayer (and sqlite3) are
    # loaded only when one does.
    from sidecar.dlq.contract import DlqStorage
    from sidecar.dlq.replay import Replayer

    Opened = Callable[[], tuple[DlqStorage, Replayer] | None]


audit = logging.getLogger("sidecar.audit")
STATUSES = ("pending", "delivered", "parked")
MAX_LIMIT = 1000


def public(rec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in rec.items() if k not in ("seq", "body_bytes", "size")}
    for k in ("created_at", "updated_at", "claimed_at", "claim_expires_at"):
        out[k] = iso(rec[k])
    return out


def _limit(raw: str | None, default: int) -> int | None:
    if raw is None:
        return default
    n = whole_number(raw)
    return n if n is not None and 1 <= n <= MAX_LIMIT else None


def dlq_routes(opened: Opened, path: Callable[[], str]) -> list[ExtraRoute]:
    """The /dlq endpoints; ``opened`` gives the open store and its replayer, or None."""

    def unavailable() -> web.Response:
        return error(
            503,
            f"no DLQ is open: no route has dlq.enabled (or {path()} could not be opened)",
        )

    async def list_records(request: web.Request) -> web.Response:
        dlq = opened()
        if dlq is None:
            return unavailable()
        store = dlq[0]
        q = request.query
        status = q.get("status")
        if status is not None and status not in STATUSES:
            return error(400, f"status must be one of {', '.join(STATUSES)}")
        limit = _limit(q.get("limit"), 50)
        if limit is None:
            return error(400, f"limit must be a whole number from 1 to {MAX_LIMIT}")
        order = q.get("order", "newest")
        if order not in ("newest", "oldest"):
            return error(400, "order must be newest or oldest")
        cursor_raw = q.get("cursor")
        cursor = whole_number(cursor_raw)
        if cursor_raw is not None and cursor is None:
            return error(400, "cursor must be the 'next' value of a previous page")
        try:
            rows, nxt = await store.list(
                route=q.get("route"),
                status=status,
                limit=limit,
                newest_first=order == "newest",
                cursor=cursor,
            )
        except DlqError as exc:
            return error(503, str(exc))
        return web.json_response(
            {"records": [public(r) for r in rows], "next": str(nxt) if nxt else None}
        )

    async def show(request: web.Request) -> web.Response:
        dlq = opened()
        if dlq is None:
            return unavailable()
        store = dlq[0]
        rid = request.match_info["id"]
        try:
            rec = await store.get(rid)
        except DlqError as exc:
            return error(503, str(exc))
        if rec is None:
            return error(404, f"no DLQ record {rid}")
        out = public(rec)
        body: bytes = rec["body_bytes"]
        try:
            out["body"] = body.decode("utf-8")
        except UnicodeDecodeError:
            out["body_base64"] = base64.b64encode(body).decode("ascii")
        return web.json_response(out)

    async def replay_one(request: web.Request) -> web.Response:
        dlq = opened()
        if dlq is None:
            return unavailable()
        rid = request.match_info["id"]
        try:
            outcome = await dlq[1].replay_one(rid)
        except RecordNotFound as exc:
            return error(404, str(exc))
        except ClaimRefused as exc:  # delivered already, being replayed, route gone
            return error(409, str(exc))
        except DlqError as exc:
            return error(503, str(exc))
        return web.json_response(outcome.as_json())

    async def replay_batch(request: web.Request) -> web.Response:
        dlq = opened()
        if dlq is None:
            return unavailable()
        raw = await request.read()
        try:
            body = loads_json(raw) if raw.strip() else {}
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, too deep
            return error(400, f"the body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        unknown = set(body) - {"route", "status", "limit", "dry_run"}
        if unknown:
            return error(400, f"unknown keys: {', '.join(sorted(unknown))}")
        status = body.get("status", "pending")
        if status not in ("pending", "parked"):
            return error(400, "status must be pending or parked")
        limit = body.get("limit", 100)
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIMIT:
            return error(400, f"limit must be a whole number from 1 to {MAX_LIMIT}")
        route = body.get("route")
        if route is not None and not isinstance(route, str):
            return error(400, "route must be a route name")
        dry_run = body.get("dry_run", False)
        if not isinstance(dry_run, bool):
            return error(400, "dry_run must be true or false")
        try:
            return web.json_response(await dlq[1].replay_batch(route, status, limit, dry_run))
        except DlqError as exc:
            return error(503, str(exc))

    async def purge(request: web.Request) -> web.Response:
        dlq = opened()
        if dlq is None:
            return unavailable()
        rid = request.match_info["id"]
        try:
            ok = await dlq[0].delete(rid)
        except RecordBusy as exc:
            return error(409, str(exc))
        except DlqError as exc:
            return error(503, str(exc))
        if not ok:
            return error(404, f"no DLQ record {rid}")
        # A purge destroys a write the client was told was accepted: who did it is kept.
        audit.warning(
            "DLQ record purged",
            extra={"fields": {"audit": "dlq.purge", "who": request.remote or "unknown", "id": rid}},
        )
        return web.json_response({"purged": rid})

    return [
        ("GET", "/dlq", list_records, True),
        ("POST", "/dlq/replay", replay_batch, True),
        ("GET", "/dlq/{id}", show, True),
        ("POST", "/dlq/{id}/replay", replay_one, True),
        ("DELETE", "/dlq/{id}", purge, True),
    ]

"""The DLQ's admin endpoints: list, show, replay, purge (README.md "Dead-letter queue")."""

from __future__ import annotations

import base64
import json
from typing import Any

from aiohttp import web

from sidecar.admin.server import ExtraRoute, error, iso
from sidecar.dlq.replay import ReplayBusy, Replayer, ReplayNotFound, ReplayRouteGone
from sidecar.dlq.store import DlqError, DlqStore

STATUSES = ("pending", "delivered", "parked")
MAX_LIMIT = 1000


def public(rec: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in rec.items() if k not in ("seq", "body_bytes", "size")}
    out["created_at"] = iso(rec["created_at"])
    out["updated_at"] = iso(rec["updated_at"])
    return out


def _limit(raw: str | None, default: int) -> int | None:
    if raw is None:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        return None
    return int(raw)


def dlq_routes(store: DlqStore, replayer: Replayer) -> list[ExtraRoute]:
    async def list_records(request: web.Request) -> web.Response:
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
        if cursor_raw is not None and not cursor_raw.isdigit():
            return error(400, "cursor must be the 'next' value of a previous page")
        try:
            rows, nxt = await store.list(
                route=q.get("route"),
                status=status,
                limit=limit,
                newest_first=order == "newest",
                cursor=int(cursor_raw) if cursor_raw else None,
            )
        except DlqError as exc:
            return error(503, str(exc))
        return web.json_response(
            {"records": [public(r) for r in rows], "next": str(nxt) if nxt else None}
        )

    async def show(request: web.Request) -> web.Response:
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
        rid = request.match_info["id"]
        try:
            outcome = await replayer.replay_one(rid)
        except ReplayNotFound as exc:
            return error(404, str(exc))
        except (ReplayBusy, ReplayRouteGone) as exc:
            return error(409, str(exc))
        except DlqError as exc:
            return error(503, str(exc))
        return web.json_response(outcome.as_json())

    async def replay_batch(request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
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
            return web.json_response(await replayer.replay_batch(route, status, limit, dry_run))
        except DlqError as exc:
            return error(503, str(exc))

    async def purge(request: web.Request) -> web.Response:
        rid = request.match_info["id"]
        if rid in replayer.in_progress:
            return error(409, f"record {rid} is being replayed")
        try:
            ok = await store.delete(rid)
        except DlqError as exc:
            return error(503, str(exc))
        if not ok:
            return error(404, f"no DLQ record {rid}")
        return web.json_response({"purged": rid})

    return [
        ("GET", "/dlq", list_records, False),
        ("POST", "/dlq/replay", replay_batch, False),
        ("GET", "/dlq/{id}", show, True),  # bodies may hold personal data: token even to read
        ("POST", "/dlq/{id}/replay", replay_one, False),
        ("DELETE", "/dlq/{id}", purge, False),
    ]


def no_dlq_routes(path: str) -> list[ExtraRoute]:
    async def unavailable(request: web.Request) -> web.Response:
        return error(
            503,
            f"no DLQ is open: no route has dlq.enabled (or {path} could not be opened)",
        )

    return [
        ("GET", "/dlq", unavailable, False),
        ("POST", "/dlq/replay", unavailable, False),
        ("GET", "/dlq/{id}", unavailable, True),
        ("POST", "/dlq/{id}/replay", unavailable, False),
        ("DELETE", "/dlq/{id}", unavailable, False),
    ]

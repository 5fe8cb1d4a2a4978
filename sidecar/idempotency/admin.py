"""The admin endpoints of the idempotency store, for a support engineer (token-gated, as every
``/dlq`` call): ``GET /idempotency/<key>`` shows what is kept under a key, ``DELETE`` forgets it
(the next request with it runs as a first one).

A key is stored under its scope (``fingerprint.stored_key``): unscoped routes store ``-`` (the
default); a route with ``scope_header`` stores the sha256 digest of that header's value, given
as ``?scope=<hex digest>`` (the header's value itself never reaches the store or this API).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from sidecar.idempotency.fingerprint import NO_SCOPE, stored_key
from sidecar.idempotency.key import GoodKey, parse_value
from sidecar.idempotency.store import IdempotencyStore, KeyRecord, StoreError
from sidecar.jsonapi import ExtraRoute, error, iso

SCOPE = re.compile(r"^(-|[0-9a-f]{64})$")


def record_json(record: KeyRecord) -> dict[str, object]:
    answer = record.answer
    kept = None
    if answer is not None:
        kept = {
            "status": answer.status,
            "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in answer.headers],
            "body_bytes": len(answer.body) if answer.body is not None else answer.size,
            "body_kept": answer.body is not None,
        }
    return {
        "stored_key": record.key,
        "state": "finished" if record.finished else "in-progress",
        "fingerprint": record.fingerprint,
        "created_at": iso(record.created_at),
        "expires_at": iso(record.expires_at),
        "answer": kept,
    }


def idempotency_routes(opened: Callable[[], IdempotencyStore | None]) -> list[ExtraRoute]:
    def where(request: web.Request) -> str | web.Response:
        parsed = parse_value(request.match_info["id"].encode("latin-1"))
        if not isinstance(parsed, GoodKey):
            return error(400, "not an Idempotency-Key: 1 to 255 visible ASCII characters")
        scope = request.query.get("scope", NO_SCOPE)
        if not SCOPE.match(scope):
            return error(400, "scope must be - or the 64 hex digits of the scope digest")
        return stored_key(parsed.value, scope)

    def unavailable() -> web.Response:
        return error(503, "no idempotency store is open: no route has idempotency.enabled")

    async def on_key(
        request: web.Request, act: Callable[[IdempotencyStore, str], Awaitable[web.Response | None]]
    ) -> web.Response:
        """The key named by the path, in the open store: ``act``'s answer, or 404 for None."""
        key, store = where(request), opened()
        if not isinstance(key, str):
            return key
        if store is None:
            return unavailable()
        try:
            answer = await act(store, key)
        except StoreError as exc:
            return error(503, f"the idempotency store failed: {exc}")
        if answer is None:
            return error(404, "no such key (never seen, expired, or forgotten)")
        return answer

    async def shown(store: IdempotencyStore, key: str) -> web.Response | None:
        record = await store.get(key)
        return None if record is None else web.json_response(record_json(record))

    async def forgotten(store: IdempotencyStore, key: str) -> web.Response | None:
        return web.json_response({"forgotten": key}) if await store.forget(key) else None

    async def show(request: web.Request) -> web.Response:
        return await on_key(request, shown)

    async def forget(request: web.Request) -> web.Response:
        return await on_key(request, forgotten)

    return [
        ("GET", "/idempotency/{id}", show, True),
        ("DELETE", "/idempotency/{id}", forget, True),
    ]

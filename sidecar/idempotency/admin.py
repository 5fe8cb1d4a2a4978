"""The admin endpoints of the idempotency store, for a support engineer (token-gated, as every
``/dlq`` call): ``GET /idempotency/<key>`` shows what is kept under a key, ``DELETE`` forgets it
(the next request with it runs as a first one).

A key is stored under its scope (``fingerprint.stored_key``): unscoped routes store ``-``; a route
with ``scope_header`` stores the sha256 digest of that header's value (the value itself never
reaches the store or this API). A key is found by the key alone, in every scope that holds it
(``holders``), each named by a label: ``-``, or the first 12 hex digits of its digest.
``?scope=`` names one: ``-``, a label, or the whole 64-hex digest.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from aiohttp import web

from sidecar.idempotency.fingerprint import NO_SCOPE, stored_key
from sidecar.idempotency.key import GoodKey, parse_value
from sidecar.idempotency.store import IdempotencyStore, KeyRecord, StoreError
from sidecar.jsonapi import ExtraRoute, error, iso

SCOPE = re.compile(r"^(-|[0-9a-f]{8,64})$")
LABEL_DIGITS = 12  # a scope's label: the first hex digits of its digest
NOT_FOUND = "no such key in any scope (never seen, expired, or forgotten)"


def scope_of(stored: str) -> str:
    """The scope part of a stored key."""
    return stored.split(" ", 1)[0]


def label(stored: str) -> str:
    """A stored key's scope as shown: ``-``, or the first hex digits of its digest."""
    scope = scope_of(stored)
    return scope if scope == NO_SCOPE else scope[:LABEL_DIGITS]


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
        "scope": label(record.key),
        "state": "finished" if record.finished else "in-progress",
        "fingerprint": record.fingerprint,
        "created_at": iso(record.created_at),
        "expires_at": iso(record.expires_at),
        "answer": kept,
    }


async def _named(store: IdempotencyStore, key: str, scope: str | None) -> list[str]:
    """The stored keys the request names: the one of a whole scope (``-``, 64 hex), else those
    of every scope holding ``key`` whose label starts with ``scope`` (all of them without)."""
    if scope is not None and (scope == NO_SCOPE or len(scope) == 64):
        return [stored_key(key, scope)]
    held = await store.holders(key)
    return [s for s in held if scope is None or scope_of(s).startswith(scope)]


def _several(held: list[str]) -> web.Response:
    labels = ", ".join(label(s) for s in held)
    return error(
        409,
        f"the key is held in {len(held)} scopes ({labels}): name one with "
        "?scope=<label> (retry-sidecar idempotency ... --scope LABEL)",
    )


def idempotency_routes(opened: Callable[[], IdempotencyStore | None]) -> list[ExtraRoute]:
    def where(request: web.Request) -> tuple[str, str | None] | web.Response:
        parsed = parse_value(request.match_info["id"].encode("latin-1"))
        if not isinstance(parsed, GoodKey):
            return error(400, "not an Idempotency-Key: 1 to 255 visible ASCII characters")
        scope = request.query.get("scope")
        if scope is not None and not SCOPE.match(scope):
            return error(
                400, "scope must be -, a scope label (8+ hex digits) or the 64-hex scope digest"
            )
        return parsed.value, scope

    def unavailable() -> web.Response:
        return error(503, "no idempotency store is open: no route has idempotency.enabled")

    async def on_key(
        request: web.Request,
        act: Callable[[IdempotencyStore, str, str | None], Awaitable[web.Response | None]],
    ) -> web.Response:
        """The key named by the path, in the open store: ``act``'s answer, or 404 for None."""
        named, store = where(request), opened()
        if isinstance(named, web.Response):
            return named
        if store is None:
            return unavailable()
        try:
            answer = await act(store, *named)
        except StoreError as exc:
            return error(503, f"the idempotency store failed: {exc}")
        if answer is None:
            return error(404, NOT_FOUND)
        return answer

    async def shown(store: IdempotencyStore, key: str, scope: str | None) -> web.Response | None:
        records = []
        for stored in await _named(store, key, scope):
            record = await store.get(stored)
            if record is not None:
                records.append(record_json(record))
        if not records:
            return None
        # Every scope holding it; one alone is also shown at the top level.
        doc: dict[str, object] = dict(records[0]) if len(records) == 1 else {}
        doc.update(key=key, scopes=records)
        return web.json_response(doc)

    async def forgotten(
        store: IdempotencyStore, key: str, scope: str | None
    ) -> web.Response | None:
        named = await _named(store, key, scope)
        if len(named) > 1:
            return _several(named)
        if not named or not await store.forget(named[0]):
            return None
        return web.json_response({"forgotten": named[0], "scope": label(named[0])})

    async def show(request: web.Request) -> web.Response:
        return await on_key(request, shown)

    async def forget(request: web.Request) -> web.Response:
        return await on_key(request, forgotten)

    return [
        ("GET", "/idempotency/{id}", show, True),
        ("DELETE", "/idempotency/{id}", forget, True),
    ]

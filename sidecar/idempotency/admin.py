"""The admin endpoints of the idempotency store, for a support engineer (token-gated, as every
``/dlq`` call): ``GET /idempotency/<key>`` shows what is kept under a key, ``DELETE`` forgets it
(the next request with it runs as a first one).

A key is stored under its route and scope (``fingerprint.stored_key``: ``<route>/<scope> <key>``):
unscoped routes store ``-``; a route with ``scope_header`` stores the sha256 digest of that
header's value (the value itself never reaches the store or this API). A name the previous
version stored (``<scope> <key>``, no route) is shown with route None. A key is found by the key
alone, on every route and in every scope that holds it (``holders``), each scope named by a
label: ``-``, or the first 12 hex digits of its digest. ``?scope=`` names one: ``-``, a label,
or the whole 64-hex digest; ``?route=`` a route (``-``: the legacy names, without one).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from sidecar.idempotency.fingerprint import NO_SCOPE
from sidecar.idempotency.key import GoodKey, parse_value
from sidecar.idempotency.store import IdempotencyStore, KeyRecord, StoreError
from sidecar.jsonapi import ExtraRoute, error, iso

SCOPE = re.compile(r"^(-|[0-9a-f]{8,64})$")
ROUTE = re.compile(r"^(-|[A-Za-z0-9][A-Za-z0-9_.-]{0,62})$")  # ``-``: a legacy name's
LABEL_DIGITS = 12  # a scope's label: the first hex digits of its digest
NOT_FOUND = "no such key in any scope (never seen, expired, or forgotten)"


def scope_of(stored: str) -> str:
    """The scope part of a stored key."""
    return stored.split(" ", 1)[0].rsplit("/", 1)[-1]


def route_of(stored: str) -> str | None:
    """The route part of a stored key; None for a legacy name (stored without its route)."""
    head = stored.split(" ", 1)[0]
    return head.split("/", 1)[0] if "/" in head else None


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
        "route": route_of(record.key),
        "scope": label(record.key),
        "state": "finished" if record.finished else "in-progress",
        "fingerprint": record.fingerprint,
        "created_at": iso(record.created_at),
        "expires_at": iso(record.expires_at),
        "answer": kept,
    }


@dataclass(frozen=True, slots=True)
class Named:
    """What a request names: the key, and optionally its scope and route."""

    key: str
    scope: str | None
    route: str | None


def _matches(stored: str, named: Named) -> bool:
    scope, route = named.scope, named.route
    if scope is not None:
        whole = scope == NO_SCOPE or len(scope) == 64
        if not (scope_of(stored) == scope if whole else scope_of(stored).startswith(scope)):
            return False
    return route is None or (route_of(stored) or NO_SCOPE) == route


async def _named(store: IdempotencyStore, named: Named) -> list[str]:
    """The stored keys the request names: those holding the key (on every route, in every
    scope, legacy names included) of the route named (all without) and whose scope is the one
    named (``-``, 64 hex) or whose label starts with ``scope`` (all without)."""
    held = await store.holders(named.key)
    return [s for s in held if _matches(s, named)]


def _shown_as(stored: str) -> str:
    route = route_of(stored)
    return f"{label(stored)} on {route if route is not None else '- (legacy)'}"


def _several(held: list[str]) -> web.Response:
    labels = ", ".join(_shown_as(s) for s in held)
    return error(
        409,
        f"the key is held in {len(held)} scopes ({labels}): name one with ?route=<name> and "
        "?scope=<label> (retry-sidecar idempotency ... --route NAME --scope LABEL)",
    )


def idempotency_routes(opened: Callable[[], IdempotencyStore | None]) -> list[ExtraRoute]:
    def where(request: web.Request) -> Named | web.Response:
        parsed = parse_value(request.match_info["id"].encode("latin-1"))
        if not isinstance(parsed, GoodKey):
            return error(400, "not an Idempotency-Key: 1 to 255 visible ASCII characters")
        scope = request.query.get("scope")
        if scope is not None and not SCOPE.match(scope):
            return error(
                400, "scope must be -, a scope label (8+ hex digits) or the 64-hex scope digest"
            )
        route = request.query.get("route")
        if route is not None and not ROUTE.match(route):
            return error(400, "route must be a route's name, or - (the names stored without one)")
        return Named(parsed.value, scope, route)

    def unavailable() -> web.Response:
        return error(503, "no idempotency store is open: no route has idempotency.enabled")

    async def on_key(
        request: web.Request,
        act: Callable[[IdempotencyStore, Named], Awaitable[web.Response | None]],
    ) -> web.Response:
        """The key named by the path, in the open store: ``act``'s answer, or 404 for None."""
        named, store = where(request), opened()
        if isinstance(named, web.Response):
            return named
        if store is None:
            return unavailable()
        try:
            answer = await act(store, named)
        except StoreError as exc:
            return error(503, f"the idempotency store failed: {exc}")
        if answer is None:
            return error(404, NOT_FOUND)
        return answer

    async def shown(store: IdempotencyStore, named: Named) -> web.Response | None:
        records = []
        for stored in await _named(store, named):
            record = await store.get(stored)
            if record is not None:
                records.append(record_json(record))
        if not records:
            return None
        # Every scope holding it; one alone is also shown at the top level.
        doc: dict[str, object] = dict(records[0]) if len(records) == 1 else {}
        doc.update(key=named.key, scopes=records)
        return web.json_response(doc)

    async def forgotten(store: IdempotencyStore, named: Named) -> web.Response | None:
        held = await _named(store, named)
        if len(held) > 1:
            return _several(held)
        if not held or not await store.forget(held[0]):
            return None
        doc = {"forgotten": held[0], "route": route_of(held[0]), "scope": label(held[0])}
        return web.json_response(doc)

    async def show(request: web.Request) -> web.Response:
        return await on_key(request, shown)

    async def forget(request: web.Request) -> web.Response:
        return await on_key(request, forgotten)

    return [
        ("GET", "/idempotency/{id}", show, True),
        ("DELETE", "/idempotency/{id}", forget, True),
    ]

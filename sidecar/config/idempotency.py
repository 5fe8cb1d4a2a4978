"""The ``idempotency:`` sections: a route's (inherited from ``defaults``), which turns the
enforcement of ``Idempotency-Key`` on for its writes, and the top level's, where the keys are
kept. Declared once here (``sidecar/config/schema.py``); ``sidecar/idempotency`` reads them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sidecar.config import checks as c
from sidecar.config.schema import key

LEASE_MARGIN = 5.0  # seconds over the route timeout when ``lease`` is not set

OnStoreError = Literal["refuse", "pass"]
# redis: the fleet's shared store; valid only with fleet.redis.url (config/fleet.py)
Backend = Literal["sqlite", "redis"]
ON_STORE_ERROR: tuple[OnStoreError, ...] = ("refuse", "pass")
BACKENDS: tuple[Backend, ...] = ("sqlite", "redis")


def _lease(value: object) -> float | None:
    return None if value is None else c.positive_duration(value)


def _header_name(value: object) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str):
        raise c.Invalid(f"expected a header name or null, got {c.kind(value)}")
    (name,) = c.header_names([value])
    return name


@dataclass(frozen=True, slots=True)
class IdempotencyPolicy:
    """A route's ``idempotency:`` section."""

    enabled: bool = key(False, c.boolean, note="true: enforce Idempotency-Key on writes")
    methods: frozenset[str] = key(frozenset({"POST", "PATCH"}), c.methods)
    required: bool = key(False, c.boolean, note="true: a guarded write without a key gets 400")
    ttl: float = key(24 * 3600.0, c.positive_duration, unit="duration")
    lease: float | None = key(None, _lease, unit="duration", note="null: the route's timeout + 5s")
    max_response_bytes: int = key(1 << 20, c.size, unit="size")
    scope_header: str | None = key(None, _header_name)
    on_store_error: OnStoreError = key("refuse", c.Choice(ON_STORE_ERROR))

    def guards(self, method: str) -> bool:
        return self.enabled and method in self.methods

    def lease_for(self, route_timeout: float) -> float:
        return self.lease if self.lease is not None else route_timeout + LEASE_MARGIN


def guarded_methods(policy: IdempotencyPolicy, matched: frozenset[str] | None) -> frozenset[str]:
    """The methods a route guards that it can receive at all: its ``idempotency.methods``
    that its ``match.methods`` (None: every method) lets through. Empty on a route that
    enables idempotency but matches only other methods (``[GET]``): dead config."""
    if not policy.enabled:
        return frozenset()
    return policy.methods if matched is None else policy.methods & matched


def dead_guard(policy: IdempotencyPolicy, matched: frozenset[str] | None) -> str | None:
    """What is wrong, with the fix, when a route enables idempotency for none of the methods
    it matches; else None. Pure."""
    if not policy.enabled or guarded_methods(policy, matched):
        return None
    assert matched is not None
    listed, guarded = ", ".join(sorted(matched)), ", ".join(sorted(policy.methods))
    return (
        f"idempotency is enabled on a route that matches only {listed}: none of them is a "
        f"guarded write (idempotency.methods: {guarded}), so no "
        "request is guarded; remove idempotency from this route (enabled: false), or add the "
        "write methods to match.methods"
    )


@dataclass(frozen=True, slots=True)
class IdempotencyStorage:
    """The top-level ``idempotency:`` section: where keys are kept."""

    # The open store is not swapped under requests in flight: both are read at start.
    backend: Backend = key("sqlite", c.Choice(BACKENDS), live=False)
    path: str = key("./data/idempotency.sqlite3", c.non_empty_str, live=False)
    # Bounds of the SQLite file (read at start): past either, a new key is refused and the
    # route's on_store_error applies (counted store-full). The fleet's Redis is bounded by its
    # own maxmemory (with maxmemory-policy noeviction).
    max_records: int = key(
        10_000_000, c.int_range(1, 1_000_000_000), live=False, note="keys kept (sqlite)"
    )
    max_bytes: int = key(
        4 * 1024**3, c.size, unit="size", live=False, note="kept answers' bytes (sqlite)"
    )

"""The idempotency settings: per route (inherited from ``defaults``) and of the store (top level).

Plain frozen dataclasses; the config schema declares and validates the YAML keys, these are
what the rest of the package is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LEASE_MARGIN = 5.0  # seconds over the route timeout when ``lease`` is not set
DEFAULT_TTL = 24 * 3600.0
DEFAULT_MAX_RESPONSE_BYTES = 1 << 20
DEFAULT_PATH = "./data/idempotency.sqlite3"

OnStoreError = Literal["refuse", "pass"]
Backend = Literal["sqlite", "redis"]


@dataclass(frozen=True, slots=True)
class IdempotencyPolicy:
    """A route's ``idempotency:`` section."""

    enabled: bool = False
    methods: frozenset[str] = frozenset({"POST", "PATCH"})
    required: bool = False  # a guarded write without a key gets 400
    ttl: float = DEFAULT_TTL  # seconds a finished answer is kept and replayed
    lease: float | None = None  # seconds a key stays in progress; None: route timeout + 5 s
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES  # larger answers are relayed, not kept
    scope_header: str | None = None  # the key is scoped by a hash of this header's value
    on_store_error: OnStoreError = "refuse"  # refuse: 503; pass: forward unguarded

    def guards(self, method: str) -> bool:
        return self.enabled and method in self.methods

    def lease_for(self, route_timeout: float) -> float:
        return self.lease if self.lease is not None else route_timeout + LEASE_MARGIN


@dataclass(frozen=True, slots=True)
class IdempotencyStorage:
    """The top-level ``idempotency:`` section: where keys are kept."""

    backend: Backend = "sqlite"
    path: str = DEFAULT_PATH

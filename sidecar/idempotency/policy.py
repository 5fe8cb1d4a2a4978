"""The idempotency settings, as the config declares them (``sidecar/config/idempotency.py``):
per route (inherited from ``defaults``) and of the store (top level)."""

from __future__ import annotations

from sidecar.config.idempotency import (
    LEASE_MARGIN,
    Backend,
    IdempotencyPolicy,
    IdempotencyStorage,
    OnStoreError,
)

__all__ = ["LEASE_MARGIN", "Backend", "IdempotencyPolicy", "IdempotencyStorage", "OnStoreError"]

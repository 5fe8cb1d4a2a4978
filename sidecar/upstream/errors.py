"""The upstream client's error types; they live in ``sidecar.core`` so that every layer can
name them without importing the upstream client."""

from __future__ import annotations

from sidecar.core import (
    AttemptTimeout,
    BadResponse,
    BodyTimeout,
    ConnectFailure,
    LocalOverload,
    NoTimeLeft,
    Overloaded,
    PoolExhausted,
    UpstreamError,
    UpstreamReset,
)

__all__ = [
    "AttemptTimeout",
    "BadResponse",
    "BodyTimeout",
    "ConnectFailure",
    "LocalOverload",
    "NoTimeLeft",
    "Overloaded",
    "PoolExhausted",
    "UpstreamError",
    "UpstreamReset",
]

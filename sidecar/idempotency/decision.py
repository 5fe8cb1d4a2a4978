"""What to do with a guarded request, given what the store holds for its key. Pure.

The store runs this inside the one transaction that reads and writes the key, so the answer is
atomic however many duplicates arrive at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum


class Decision(StrEnum):
    FIRST = "first"  # nothing (live) under K: claim it, send the request
    REPLAYED = "replayed"  # K finished for this same request: answer what was kept
    IN_PROGRESS = "in-progress"  # K held by a live claim for this same request: 409
    MISMATCH = "mismatch"  # K belongs to another request: 422
    LEASE_EXPIRED = "lease-expired"  # K held, but its holder's lease passed: take it over


@dataclass(frozen=True, slots=True)
class KeyState:
    """What the store holds for a key."""

    finished: bool  # False: in progress (claimed, not completed)
    fingerprint: str
    expires_at: float  # wall clock: the lease's end (in progress) or the ttl's end (finished)


def decide(state: KeyState | None, fingerprint: str, now: float) -> Decision:
    """A finished key past its ttl is gone. Another request under a key is a mismatch whatever
    the key's state (a client bug, told at once rather than after a 409); an abandoned claim
    stays the other request's until it is pruned."""
    if state is None or (state.finished and state.expires_at <= now):
        return Decision.FIRST
    if state.fingerprint != fingerprint:
        return Decision.MISMATCH
    if state.finished:
        return Decision.REPLAYED
    if state.expires_at > now:
        return Decision.IN_PROGRESS
    return Decision.LEASE_EXPIRED


def retry_after(expires_at: float, now: float) -> int:
    """The ``Retry-After`` of a 409: the holder's remaining lease in whole seconds, at least 1."""
    return max(1, math.ceil(expires_at - now))

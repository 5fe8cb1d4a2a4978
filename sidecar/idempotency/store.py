"""The contract of an idempotency store, whatever keeps the keys.

A key is in one of three states: absent, in progress (claimed, with a lease and a claim token)
or finished (with its fingerprint and kept answer, until its ttl passes). ``claim`` reads and
writes the key in one atomic step, deciding with ``decision.decide``; only the holder of the
claim token may ``complete``, ``release`` or ``renew`` it (a compare-and-set), so a holder whose
lease was taken over cannot overwrite the new holder's key. The holder renews its lease while its
request runs, so the lease only runs out when its holder is gone (a killed sidecar).

Every call is bounded: a store that cannot answer in time raises ``StoreError`` and the caller
applies the route's ``on_store_error``. A claim that failed leaves no key (SQLite: its
transaction rolled back; a store whose call may land after it timed out must undo it), so it
never holds a key nobody owns.

How a Redis backend implements it (one string key per idempotency key, ``<prefix>:<stored key>``,
a hash or a packed value: state, fingerprint, token, expiry, answer):

- ``claim``: a Lua script, atomic on the server: ``GET``; if absent (or finished and expired):
  ``SET key <held, fp, token> NX PX <lease>`` -> Claimed; finished, same fingerprint ->
  Finished; another fingerprint -> Mismatch; held and its ``PTTL`` > 0 -> Busy(now + PTTL);
  held past its lease -> overwrite with the new token -> Claimed (taken over). The key's own
  ``PX`` is the lease plus the time an abandoned claim is kept, so Redis expires it by itself.
- ``complete``: Lua compare-and-set: if the stored token equals ours, ``SET key <finished, fp,
  answer> PX <ttl>``, else nothing (returns whether it wrote).
- ``release``: Lua compare-and-delete on the token (``if token == ARGV[1] then DEL``).
- ``renew``: Lua compare-and-set on the token, in progress only: if the stored token equals
  ours and the key is held, ``PEXPIRE key <lease + abandoned keep>`` and write the new lease end
  into the value; else nothing (returns whether it renewed).
- ``get`` / ``forget``: ``GET`` / ``DEL``; ``prune``: nothing to do (``PX`` expires keys).
- time: the server's clock (``TIME``, inside the claim, complete and renew scripts), so
  replicas need not agree on theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from sidecar.idempotency.keep import KeptAnswer

ABANDONED_KEEP = 24 * 3600.0  # seconds an abandoned claim is kept past its lease (counted)


class StoreError(Exception):
    """The store could not answer (unreachable, failing, or slower than its timeout)."""


class StoreFull(StoreError):
    """A new key refused: the store holds ``idempotency.max_records`` keys or
    ``max_bytes`` bytes already (the route's ``on_store_error`` applies, counted
    ``store-full``)."""


@dataclass(frozen=True, slots=True)
class Claimed:
    token: str  # the claim's proof of ownership for complete/release
    took_over: bool = False  # a dead holder's lease had passed (counted as lease-expired)


@dataclass(frozen=True, slots=True)
class Busy:
    expiry: float  # wall clock: when the holder's lease ends


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key: str  # the stored key (scope digest and key)
    finished: bool
    fingerprint: str
    created_at: float  # wall clock: claimed (in progress) or completed (finished)
    expires_at: float  # wall clock: lease end (in progress) or ttl end (finished)
    answer: KeptAnswer | None  # the kept answer of a finished key


@dataclass(frozen=True, slots=True)
class Finished:
    record: KeyRecord


@dataclass(frozen=True, slots=True)
class Mismatch:
    pass


ClaimResult = Claimed | Busy | Finished | Mismatch


class IdempotencyStore(Protocol):
    async def claim(self, key: str, fingerprint: str, lease: float) -> ClaimResult: ...

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> bool:
        """True when the key was ours and is now finished; False when it was not ours any
        more (taken over after our lease, or forgotten)."""
        ...

    async def release(self, key: str, token: str) -> bool:
        """True when the key was ours and is now absent."""
        ...

    async def renew(self, key: str, token: str, lease: float) -> bool:
        """The holder's heartbeat: its lease ends ``lease`` from now. True when the key was ours
        and still in progress; False when it was not ours any more (taken over, forgotten,
        finished)."""
        ...

    async def get(self, key: str) -> KeyRecord | None: ...

    async def forget(self, key: str) -> bool: ...

    async def prune(self, limit: int) -> int:
        """Delete at most ``limit`` expired keys; the number deleted."""
        ...


class StoreNotOpen:
    """The store of a process whose idempotency file is not open (yet, or any more): every
    call is a ``StoreError``, so the route's ``on_store_error`` applies."""

    async def claim(self, key: str, fingerprint: str, lease: float) -> ClaimResult:
        raise StoreError("the idempotency store is not open")

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> bool:
        raise StoreError("the idempotency store is not open")

    async def release(self, key: str, token: str) -> bool:
        raise StoreError("the idempotency store is not open")

    async def renew(self, key: str, token: str, lease: float) -> bool:
        raise StoreError("the idempotency store is not open")

    async def get(self, key: str) -> KeyRecord | None:
        raise StoreError("the idempotency store is not open")

    async def forget(self, key: str) -> bool:
        raise StoreError("the idempotency store is not open")

    async def prune(self, limit: int) -> int:
        raise StoreError("the idempotency store is not open")


NOT_OPEN: IdempotencyStore = StoreNotOpen()

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

- ``claim``: a Lua script, atomic on the server (the legacy name a second key it only
  reads): ``GET``; if absent (or finished and expired):
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
- ``holders``: the unscoped name read directly, the scoped ones found with ``SCAN MATCH
  <prefix>idem:<64 any> <key>`` (an admin call, never on the request path).
- time: the server's clock (``TIME``, inside the claim, complete and renew scripts), so
  replicas need not agree on theirs.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

from sidecar.idempotency.answer import NOT_KEPT_HEADERS, Headers
from sidecar.idempotency.keep import KeptAnswer

ABANDONED_KEEP = 24 * 3600.0  # seconds an abandoned claim is kept past its lease (counted)
HOLDERS_MAX = 100  # the scopes listed for one key (``holders``)


class StoreError(Exception):
    """The store could not answer (unreachable, failing, or slower than its timeout)."""


# RFC 9110 5.1 and 5.5: a field name is a token; a field value holds no CR, LF, NUL nor any
# other control but HTAB.
_FIELD_NAME = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+\Z")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*\Z")


def headers_text(headers: Headers) -> str:
    """Kept headers as a store holds them: a JSON list of [name, value] (latin-1)."""
    return json.dumps([[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers])


def read_answer(status: object, headers: object, body: object, size: object) -> KeptAnswer:
    """A kept answer read back from a store, checked before anything may write it to a wire:
    a final status, ``headers`` a JSON list of [name, value] whose names are tokens (and none a
    framing or hop-by-hop field, never kept) and whose values hold no CR, LF, NUL or other
    control, ``body`` bytes or None, ``size`` a count or None. A record that does not fit
    (damaged, or written by someone else into a shared store) is a ``StoreError``: the route's
    ``on_store_error`` applies and it is never replayed."""
    try:
        code = int(status) if isinstance(status, (int, str, bytes)) else -1
    except ValueError:
        code = -1
    if not 200 <= code <= 599:
        raise StoreError(f"damaged kept answer: status {status!r}")
    if isinstance(headers, bytes):
        headers = headers.decode("latin-1")
    try:
        pairs = json.loads(headers) if isinstance(headers, str) and headers else []
    except ValueError:
        raise StoreError("damaged kept answer: headers are not JSON") from None
    if not isinstance(pairs, list):
        raise StoreError("damaged kept answer: headers are not a list")
    fields: list[tuple[bytes, bytes]] = []
    for pair in pairs:
        if not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)
        ):
            raise StoreError("damaged kept answer: a header is not a [name, value] pair")
        try:
            name, value = pair[0].encode("latin-1"), pair[1].encode("latin-1")
        except UnicodeEncodeError:
            raise StoreError("damaged kept answer: a header is not latin-1") from None
        if not _FIELD_NAME.match(name) or name.lower() in NOT_KEPT_HEADERS:
            raise StoreError(f"damaged kept answer: header name {name!r}")
        if not _FIELD_VALUE.match(value):
            raise StoreError(f"damaged kept answer: the value of {name!r} is not a field value")
        fields.append((name, value))
    if body is not None and not isinstance(body, bytes):
        raise StoreError("damaged kept answer: body is not bytes")
    if size is not None and not (isinstance(size, int) and size >= 0):
        raise StoreError(f"damaged kept answer: size {size!r}")
    return KeptAnswer(code, tuple(fields), body, size)


class StoreFull(StoreError):
    """A new key refused: the store holds ``idempotency.max_records`` keys or
    ``max_bytes`` bytes already (the route's ``on_store_error`` applies, counted
    ``store-full``); or a write refused by a Redis at its ``maxmemory`` (``noeviction``):
    Redis answered, so the link stays up."""


class Kept(IntEnum):
    """What ``complete`` did: false when the key was not ours any more (taken over after our
    lease, or forgotten), true when it is now finished."""

    NOT_OURS = 0
    WHOLE = 1  # the whole answer kept
    # Finished with the answer's status only (``keep.without_body``): the whole answer would
    # have put the store past its bound (``max_bytes``, a Redis at its ``maxmemory``). Counted
    # ``store-full``; a duplicate gets the ``answer-not-kept`` replay.
    WITHOUT_BODY = 2


@dataclass(frozen=True, slots=True)
class Claimed:
    token: str  # the claim's proof of ownership for complete/release
    took_over: bool = False  # a dead holder's lease had passed (counted as lease-expired)


@dataclass(frozen=True, slots=True)
class Busy:
    expiry: float  # wall clock: when the holder's lease ends


@dataclass(frozen=True, slots=True)
class KeyRecord:
    key: str  # the stored key (route, scope digest and key; or a legacy name)
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
    async def claim(
        self, key: str, fingerprint: str, lease: float, legacy: str | None = None
    ) -> ClaimResult:
        """``legacy``: the name the previous version stored the same key under
        (``fingerprint.legacy_key``). While ``key`` is absent, a live key under ``legacy`` is
        judged as if it were ``key``'s (finished: replayed or a mismatch; in progress: busy
        or a mismatch), read only, in the same atomic step; a legacy key past its ttl or
        lease is as absent."""
        ...

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> Kept:
        """``Kept.WHOLE`` (or ``WITHOUT_BODY``, at the store's bound) when the key was ours and
        is now finished; ``NOT_OURS`` (false) when it was not ours any more (taken over after
        our lease, or forgotten)."""
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

    async def holders(self, key: str) -> list[str]:
        """The stored keys (``fingerprint.stored_key``: one per route and scope, and any
        legacy name) that hold the client's ``key``, in any state, at most ``HOLDERS_MAX``:
        how a support engineer finds a key by the key alone."""
        ...

    async def prune(self, limit: int) -> int:
        """Delete at most ``limit`` expired keys; the number deleted."""
        ...


class StoreNotOpen:
    """The store of a process whose idempotency file is not open (yet, or any more): every
    call is a ``StoreError``, so the route's ``on_store_error`` applies."""

    async def claim(
        self, key: str, fingerprint: str, lease: float, legacy: str | None = None
    ) -> ClaimResult:
        raise StoreError("the idempotency store is not open")

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> Kept:
        raise StoreError("the idempotency store is not open")

    async def release(self, key: str, token: str) -> bool:
        raise StoreError("the idempotency store is not open")

    async def renew(self, key: str, token: str, lease: float) -> bool:
        raise StoreError("the idempotency store is not open")

    async def get(self, key: str) -> KeyRecord | None:
        raise StoreError("the idempotency store is not open")

    async def forget(self, key: str) -> bool:
        raise StoreError("the idempotency store is not open")

    async def holders(self, key: str) -> list[str]:
        raise StoreError("the idempotency store is not open")

    async def prune(self, limit: int) -> int:
        raise StoreError("the idempotency store is not open")


NOT_OPEN: IdempotencyStore = StoreNotOpen()

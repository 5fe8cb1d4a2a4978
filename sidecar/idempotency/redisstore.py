"""The fleet's idempotency store: keys in the Redis the sidecars share (``fleet.redis``), so a
duplicate that a load balancer sends to another replica finds the key.

One hash per key, ``<key_prefix>idem:<stored key>``: ``finished``, ``fingerprint``, ``token``,
``created_at``, ``expires_at`` and, once finished, the kept answer (``status``, ``headers``,
``body``, ``kept``, ``size``). The calls map onto Redis as ``store.py`` says:

- ``claim``: one Lua script, one round trip (``EVALSHA``): an absent key (which ``decide``
  judges ``first`` whatever the request) is claimed on the spot; otherwise the script writes
  nothing and answers the key's fields with the server's ``now``, and ``decide`` -- the same
  pure function as every store's, the one copy of the decision -- judges them here. When it
  says the key may be taken (a lease run out, or a finished key past its ttl) the script runs
  once more, told the state that was judged: it writes the claim only if the key still holds
  exactly that state (a compare-and-set on ``finished``, ``fingerprint``, ``token``,
  ``expires_at``), else it answers the new state to judge again. So concurrent claims of one
  key from any number of sidecars give one ``Claimed``, and a fresh key (every first write)
  costs one round trip. An in-progress key expires by itself (``PEXPIRE``) ``ABANDONED_KEEP``
  after its lease, a finished one after its ttl: ``prune`` has nothing to do.
- ``complete`` / ``release``: Lua compare-and-set / compare-and-delete on the claim token,
  atomic on the server.
- ``get`` / ``forget``: ``HGETALL`` / ``DEL``.

Times are the server's clock (``TIME``, read inside the claim, complete and renew scripts), so
replicas need not agree on their wall clocks: expiry stamps are compared by ``decide`` against
Redis's ``now``; Redis's own expiry uses durations only. (A ``Busy``'s expiry is told on the
caller's wall clock.) Every call is bounded by ``fleet.redis.timeout`` (``FleetLink``); past
it, or while the link pauses after a failure, the call is a ``StoreError`` and the route's
``on_store_error`` applies. A claim that timed out or was cancelled after it was sent is undone:
its token is released (and once more a timeout later). Such a claim cannot land late either: it
carries the call's deadline mapped onto Redis's clock (``redisreply.RedisClock``, learnt from the
``now`` of earlier replies, and with one ``TIME`` before the first claim), and a script that runs
past it writes nothing: a write refused with ``store-unavailable`` during a Redis stall leaves no
key for its retry to find. Every reply is checked for shape (``redisreply``): one that does not
fit is a ``BadReply``, a failure of the link, so ``on_store_error`` applies.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import secrets
from collections.abc import Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from sidecar.core import Clock
from sidecar.fleet.connection import BadReply, FleetFull, FleetLink, FleetUnavailable
from sidecar.idempotency import redisreply as shape
from sidecar.idempotency.decision import Decision, KeyState, decide
from sidecar.idempotency.keep import KeptAnswer, without_body
from sidecar.idempotency.store import (
    ABANDONED_KEEP,
    HOLDERS_MAX,
    Busy,
    Claimed,
    ClaimResult,
    Finished,
    Kept,
    KeyRecord,
    Mismatch,
    StoreError,
    StoreFull,
    headers_text,
    read_answer,
)

if TYPE_CHECKING:
    from redis.asyncio import Redis

T = TypeVar("T")
SCAN_COUNT = 1000  # keys a SCAN round looks at (``holders``)
# The part of a stored name before its space: ``<route>/<scope>`` (``stored_key``), or a legacy
# name's ``<scope>`` (``legacy_key``), the scope ``-`` or a 64-hex digest.
NAME_HEAD = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]{0,62}/)?(-|[0-9a-f]{64})\Z")
ROUNDS = 50  # rounds of one claim (each lost to another writer) before it is a store error

# The server's clock, in seconds (``TIME``: seconds and microseconds), as a string of the
# exact decimal (Lua's tostring would round to 14 digits).
_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
"""
# The fields a claim's compare-and-set compares: what ``decide`` reads, and the token.
VERSION = ("finished", "fingerprint", "token", "expires_at")
# KEYS[1]: the key; KEYS[2] (optional): its legacy name (``fingerprint.legacy_key``), only read;
# ARGV: fingerprint, token, lease (seconds), px (the lease plus the abandoned keep), the state
# judged ('' on a first try: claim only an absent key; else VERSION's fields joined by '|':
# claim only over exactly that state), the deadline on the server's clock ('': none), the
# legacy key's state judged ('': none; else claim only while it still holds exactly that).
# Answers {1, now}: claimed an absent key; {2, now}: claimed over the state judged; {0, now,
# fields}: nothing written, judge these; {3, now}: run past its deadline (the sidecar gave up on
# it), nothing written; {4, now, fields}: the key absent, its legacy name live: judge these.
_CLAIM = (
    _NOW
    + """
local nowtext = string.format('%.6f', now)
if ARGV[6] ~= '' and now > tonumber(ARGV[6]) then
  return {3, nowtext}
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  local v = redis.call('HMGET', KEYS[1], 'finished', 'fingerprint', 'token', 'expires_at')
  local held = (v[1] or '') .. '|' .. (v[2] or '') .. '|' .. (v[3] or '') .. '|' .. (v[4] or '')
  if ARGV[5] == '' or held ~= ARGV[5] then
    return {0, nowtext, redis.call('HGETALL', KEYS[1])}
  end
elseif KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then
  local v = redis.call('HMGET', KEYS[2], 'finished', 'fingerprint', 'token', 'expires_at')
  local held = (v[1] or '') .. '|' .. (v[2] or '') .. '|' .. (v[3] or '') .. '|' .. (v[4] or '')
  if held ~= ARGV[7] then
    return {4, nowtext, redis.call('HGETALL', KEYS[2])}
  end
end
local code = 1
if ARGV[5] ~= '' and redis.call('DEL', KEYS[1]) == 1 then
  code = 2
end
redis.call('HSET', KEYS[1], 'finished', '0', 'fingerprint', ARGV[1], 'token', ARGV[2],
  'created_at', nowtext, 'expires_at', string.format('%.6f', now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return {code, nowtext}
"""
)
# KEYS[1]: the key; ARGV: token, ttl (seconds), status, headers, body, kept, size, px
_COMPLETE = (
    _NOW
    + """
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1]
   or redis.call('HGET', KEYS[1], 'finished') ~= '0' then
  return 0
end
redis.call('HSET', KEYS[1], 'finished', '1', 'token', '', 'created_at', string.format('%.6f', now),
  'expires_at', string.format('%.6f', now + tonumber(ARGV[2])), 'status', ARGV[3],
  'headers', ARGV[4], 'body', ARGV[5], 'kept', ARGV[6], 'size', ARGV[7])
redis.call('PEXPIRE', KEYS[1], ARGV[8])
return 1
"""
)
# KEYS[1]: the key; ARGV[1]: the token
_RELEASE = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'finished') == '0' then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
# KEYS[1]: the key; ARGV: token, lease (seconds), px (the lease plus the abandoned keep)
_RENEW = (
    _NOW
    + """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1]
   and redis.call('HGET', KEYS[1], 'finished') == '0' then
  redis.call('HSET', KEYS[1], 'expires_at', string.format('%.6f', now + tonumber(ARGV[2])))
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return 1
end
return 0
"""
)


def _glob(text: str) -> str:
    """``text`` matched literally in a Redis glob pattern (``SCAN MATCH``)."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)


def _ms(seconds: float) -> int:
    return max(1, math.ceil(seconds * 1000))


Fields = Mapping[bytes | str, bytes | str]  # HGETALL (bytes: the client decodes nothing)


def _raw(fields: Fields, name: str) -> bytes:
    value = fields.get(name.encode(), b"")
    return value.encode() if isinstance(value, str) else value


def _text(fields: Fields, name: str) -> str:
    return _raw(fields, name).decode()


def _state(fields: Fields) -> KeyState | None:
    if not fields:
        return None
    finished = _text(fields, "finished")
    if finished not in ("0", "1"):
        raise BadReply(f"an idempotency key in Redis holds finished={finished!r}")
    return KeyState(
        finished == "1",
        _text(fields, "fingerprint"),
        shape.number(_raw(fields, "expires_at")),
    )


def _record(key: str, fields: Fields) -> KeyRecord:
    """A key's hash as a record; one that does not fit (damaged, tampered with) is a
    ``StoreError``, its kept answer checked by ``read_answer`` before it may be replayed."""
    try:
        finished = _raw(fields, "finished") == b"1"
        answer = None
        if finished:
            body = _raw(fields, "body") if _raw(fields, "kept") == b"1" else None
            size_raw = _raw(fields, "size")
            size = int(size_raw) if size_raw.isdigit() else (None if not size_raw else -1)
            answer = read_answer(_raw(fields, "status"), _raw(fields, "headers"), body, size)
        return KeyRecord(
            key,
            finished,
            _text(fields, "fingerprint"),
            float(_text(fields, "created_at")),
            float(_text(fields, "expires_at")),
            answer,
        )
    except (ValueError, UnicodeDecodeError) as exc:
        raise StoreError(f"damaged idempotency record: {exc}") from None


class RedisIdempotencyStore:
    """``IdempotencyStore`` in the fleet's Redis. Opening makes no connection (the first call
    does); ``close`` waits for the undos in flight, then closes the client."""

    def __init__(
        self, link: FleetLink, clock: Clock, *, abandoned_keep: float = ABANDONED_KEEP
    ) -> None:
        self._link = link
        self._clock = clock
        self._abandoned_keep = abandoned_keep
        self._prefix = link.prefix + "idem:"
        self._claim = link.client.register_script(_CLAIM)
        self._complete = link.client.register_script(_COMPLETE)
        self._release = link.client.register_script(_RELEASE)
        self._renew = link.client.register_script(_RENEW)
        self._undos: set[asyncio.Task[None]] = set()
        self._redis_clock = shape.RedisClock()

    @property
    def connected(self) -> bool:
        return self._link.connected

    def _name(self, key: str) -> str:
        return self._prefix + key

    async def _call(self, fn: Callable[[Redis], Awaitable[T]]) -> T:
        try:
            return await self._link.call(fn)
        except FleetFull as exc:  # Redis at its maxmemory: it answered, the write refused
            raise StoreFull(str(exc)) from None
        except FleetUnavailable as exc:
            raise StoreError(str(exc)) from None

    async def claim(
        self, key: str, fingerprint: str, lease: float, legacy: str | None = None
    ) -> ClaimResult:
        token = secrets.token_hex(16)
        name = self._name(key)
        names = [name] if legacy is None else [name, self._name(legacy)]
        args = [fingerprint, token, repr(float(lease)), str(_ms(lease + self._abandoned_keep))]
        # At or before the link's own deadline for this call (it starts counting later).
        deadline = self._clock.monotonic() + self._link.timeout

        async def run(client: Redis) -> ClaimResult:
            judged = ""  # first try: claim the key only if it is absent
            judged_legacy = ""  # the legacy name's state judged claimable ('': none yet)
            took_over = legacy_took_over = False
            if self._redis_clock.offset is None:
                await self._learn_time(client)
            for _ in range(ROUNDS):
                with shape.checking("a claim"):
                    deadline_text = self._redis_clock.deadline(deadline)
                    got = await self._claim_round(
                        client, names, [*args, judged, deadline_text, judged_legacy]
                    )
                reply = shape.claim_reply(got)
                code, now = reply.code, reply.now
                self._redis_clock.learn(now, self._clock.monotonic())
                if code == 3:
                    raise StoreError("the claim reached Redis after its deadline; nothing written")
                if code in (1, 2):
                    taken = (took_over and code == 2) or legacy_took_over
                    return Claimed(token, took_over=taken)
                fields = reply.fields or {}
                with shape.checking("a claim"):
                    decision = decide(_state(fields), fingerprint, now)
                    if code == 4 and legacy is not None:  # the legacy name, read only
                        if decision is Decision.REPLAYED:
                            return Finished(_record(legacy, fields))
                        if decision in (Decision.FIRST, Decision.LEASE_EXPIRED):
                            judged_legacy = "|".join(_text(fields, n) for n in VERSION)
                            legacy_took_over = decision is Decision.LEASE_EXPIRED
                            continue
                    if decision is Decision.IN_PROGRESS:
                        # The holder's lease end, told on this sidecar's wall clock.
                        left = shape.number(_raw(fields, "expires_at")) - now
                        return Busy(self._clock.wall() + left)
                    if decision is Decision.MISMATCH:
                        return Mismatch()
                    if decision is Decision.REPLAYED:
                        return Finished(_record(key, fields))
                # FIRST (finished, past its ttl) or LEASE_EXPIRED: claim over what was judged.
                judged = "|".join(_text(fields, n) for n in VERSION)
                took_over = decision is Decision.LEASE_EXPIRED
            raise StoreError(f"the claim of one key lost {ROUNDS} rounds to other writers")

        try:
            return await self._call(run)
        except StoreFull:
            raise  # refused before any write: nothing to undo
        except (StoreError, asyncio.CancelledError):
            self._undo(key, token)  # the claim may have reached Redis after all
            raise

    async def _learn_time(self, client: Redis) -> None:
        """Redis's clock before the first claim (later ones learn it from the claims)."""
        with shape.checking("TIME"):
            got = await client.time()
        self._redis_clock.learn(shape.redis_time(got), self._clock.monotonic())

    async def _claim_round(self, client: Redis, names: list[str], args: list[str]) -> list[Any]:
        """One run of the claim script: one round trip. A Redis at its ``maxmemory`` with
        ``noeviction`` refuses the script at its first write (``OOM``), before anything is
        written: the link makes it a ``FleetFull`` (the link stays up), here a ``StoreFull``."""
        reply: list[Any] = await self._claim(keys=names, args=args, client=client)
        return reply

    @staticmethod
    async def _flag(script: Any, name: str, args: list[Any], client: Redis, what: str) -> bool:
        """One script answering 0 or 1, checked."""
        with shape.checking(what):
            got = await script(keys=[name], args=args, client=client)
        return shape.flag(got, what)

    def _undo(self, key: str, token: str) -> None:
        task = asyncio.get_running_loop().create_task(self._undo_claim(key, token))
        self._undos.add(task)
        task.add_done_callback(self._undos.discard)

    async def _undo_claim(self, key: str, token: str) -> None:
        for attempt in range(2):
            with contextlib.suppress(StoreError):
                if await self.release(key, token):
                    return
            if attempt == 0:
                await asyncio.sleep(self._link.timeout)

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> Kept:
        """A keep refused with ``OOM`` (Redis at its ``maxmemory``) is tried once more without
        the body (``WITHOUT_BODY``: the key finished, a duplicate gets ``answer-not-kept``);
        refused again, a ``StoreFull`` (the background retrier tries again, the key held)."""
        try:
            return Kept.WHOLE if await self._keep(key, token, answer, ttl) else Kept.NOT_OURS
        except StoreFull:
            if answer.body is None:
                raise
        done = await self._keep(key, token, without_body(answer), ttl)
        return Kept.WITHOUT_BODY if done else Kept.NOT_OURS

    async def _keep(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> bool:
        args: list[bytes | str] = [
            token,
            repr(float(ttl)),
            str(answer.status),
            headers_text(answer.headers),
            answer.body if answer.body is not None else b"",
            "1" if answer.body is not None else "0",
            "" if answer.size is None else str(answer.size),
            str(_ms(ttl)),
        ]
        name = self._name(key)
        done = await self._call(lambda c: self._flag(self._complete, name, args, c, "a keep"))
        return done

    async def release(self, key: str, token: str) -> bool:
        name = self._name(key)
        done = await self._call(lambda c: self._flag(self._release, name, [token], c, "a release"))
        return done

    async def renew(self, key: str, token: str, lease: float) -> bool:
        name = self._name(key)
        args = [token, repr(float(lease)), str(_ms(lease + self._abandoned_keep))]
        done = await self._call(lambda c: self._flag(self._renew, name, args, c, "a renewal"))
        return done

    async def get(self, key: str) -> KeyRecord | None:
        name = self._name(key)

        async def read(c: Redis) -> KeyRecord | None:
            with shape.checking("HGETALL"):
                fields = shape.hash_fields(await c.hgetall(name), "HGETALL")
                return _record(key, fields) if fields else None

        return await self._call(read)

    async def forget(self, key: str) -> bool:
        name = self._name(key)

        async def delete(c: Redis) -> bool:
            with shape.checking("DEL"):
                return shape.flag(await c.delete(name), "DEL")

        return await self._call(delete)

    async def holders(self, key: str) -> list[str]:
        """Every name (a route and scope, or a legacy scope; a space; the key) found with
        ``SCAN MATCH``, one bounded call per round of ``SCAN_COUNT``."""
        found: list[str] = []
        pattern = _glob(self._prefix) + "* " + _glob(key)
        start = len(self._prefix)
        cursor: int = 0

        def scan(at: int) -> Callable[[Redis], Awaitable[tuple[int, list[bytes | str]]]]:
            return lambda c: c.scan(cursor=at, match=pattern, count=SCAN_COUNT)

        while True:
            cursor, names = await self._call(scan(cursor))
            for name in names:
                stored = (name.decode("latin-1") if isinstance(name, bytes) else name)[start:]
                head, _, rest = stored.partition(" ")
                if rest == key and NAME_HEAD.match(head) and stored not in found:
                    found.append(stored)
            if cursor == 0 or len(found) >= HOLDERS_MAX:
                return sorted(found)[:HOLDERS_MAX]

    async def prune(self, limit: int) -> int:
        return 0  # Redis expires keys by itself (PEXPIRE)

    async def close(self) -> None:
        if self._undos:
            await asyncio.wait(set(self._undos), timeout=2 * self._link.timeout)
        for task in self._undos:
            task.cancel()
        await self._link.close()

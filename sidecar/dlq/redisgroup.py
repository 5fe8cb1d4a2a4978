"""The redrive's work list on the fleet's Redis: each route's stream and its consumer group
``redrive``, one consumer per sidecar process (``<HOSTNAME>:<pid>``), for ``redisstore``.

A consumer is created by its first read and would stay in the group forever; each start adds
one per route. So consumers are removed, and only ever one that holds no pending entries
(``XGROUP DELCONSUMER`` drops a consumer's pending entries: the records would have no
consumer to be read again through, until nothing): a sidecar removes its own at a clean stop
(``leave``) when it holds nothing, and each redrive round removes the others that hold nothing
and were idle for ``IDLE_MAX`` (``sweep``; a dead sidecar's pending entries are taken over by
``XAUTOCLAIM`` after the claim lease first, so its consumer empties and then goes). Both are one
Lua script, so the check and the removal are atomic against a read that would add an entry.
Removing a live consumer that merely sat idle costs nothing: its next read creates it again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from sidecar.dlq.contract import Ids
from sidecar.dlq.errors import DlqUnavailable

if TYPE_CHECKING:
    from redis.asyncio import Redis

Call = Callable[[Callable[["Redis"], Awaitable[Any]]], Awaitable[Any]]
Raw = list[Any]
GROUP = "redrive"
# Idle consumers holding nothing are removed after this. Longer than the redrive's longest
# pause between two reads of a live sidecar (its back-off, 300 s, and any sane
# redrive.interval), so live consumers are seldom recreated; short enough that a crash loop
# leaves a few dozen at most. It is no safety bound: a consumer with pending entries stays.
IDLE_MAX = 600.0

# KEYS: the route streams; ARGV: group, consumer. -> how many streams it left (it held nothing
# there); a stream where it holds entries keeps it (another sidecar XAUTOCLAIMs them).
LEAVE = """
local n = 0
for _, stream in ipairs(KEYS) do
  local p = redis.pcall('XPENDING', stream, ARGV[1], '-', '+', 1, ARGV[2])
  if type(p) == 'table' and p.err == nil and #p == 0 then
    redis.call('XGROUP', 'DELCONSUMER', stream, ARGV[1], ARGV[2])
    n = n + 1
  end
end
return n
"""

# KEYS[1]: a route stream; ARGV: group, idle (ms), the caller's own consumer. -> the names of
# the consumers removed: those other than the caller, with no pending entry, idle longer.
SWEEP = """
local info = redis.pcall('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])
if type(info) ~= 'table' or info.err ~= nil then return {} end
local gone = {}
for _, c in ipairs(info) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['name'] ~= ARGV[3] and f['pending'] == 0 and f['idle'] > tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    table.insert(gone, f['name'])
  end
end
return gone
"""


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedriveGroup:
    """The consumer group of each route stream under ``prefix``, as this sidecar's consumer
    ``consumer`` sees it. ``call`` runs one bounded call on the store's link."""

    def __init__(self, client: Redis, call: Call, prefix: str, consumer: str) -> None:
        self._call = call
        self.prefix = prefix
        self.consumer = consumer
        self._leave = client.register_script(LEAVE)
        self._sweep = client.register_script(SWEEP)
        self.idle_max = IDLE_MAX
        self._known: set[str] = set()  # routes whose consumer group is known to exist
        self.joined: set[str] = set()  # routes this consumer read from (it exists there)

    def forget(self) -> None:
        """The Redis lost its data: every group is created again on its next read."""
        self._known.clear()

    def _rec(self, rid: str) -> str:
        return f"{self.prefix}rec:{rid}"

    async def _ensure(self, route: str) -> None:
        if route in self._known:
            return
        from redis.exceptions import ResponseError

        stream = self.prefix + route

        async def create(c: Redis) -> None:
            try:
                await c.xgroup_create(stream, GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

        await self._call(create)
        self._known.add(route)

    async def due(self, route: str, limit: int, idle: float) -> Ids:
        """Entries of the route's stream for this sidecar: those whose consumer left them
        unacknowledged for ``idle`` seconds (it died: ``XAUTOCLAIM``), its own still pending
        (they failed before), and new ones (``XREADGROUP >``), oldest first. Entries whose
        record is gone or no longer pending are acknowledged and deleted here. Then the
        idle consumers holding nothing are swept out."""
        from redis.exceptions import ResponseError

        await self._ensure(route)
        stream = self.prefix + route
        me = self.consumer

        async def read(c: Redis) -> Raw:
            async with c.pipeline(transaction=False) as pipe:
                pipe.xautoclaim(stream, GROUP, me, int(idle * 1000), "0-0", count=limit)
                pipe.xreadgroup(GROUP, me, {stream: "0"}, count=limit)
                pipe.xreadgroup(GROUP, me, {stream: ">"}, count=limit)
                return await pipe.execute()

        self.joined.add(route)
        try:
            taken, mine, new = await self._call(read)
        except DlqUnavailable:
            self._known.discard(route)  # a Redis that lost the group (no AOF) gets it again
            raise
        except ResponseError:  # NOGROUP: the stream was deleted under us
            self._known.discard(route)
            return []
        entries: dict[str, str] = {}
        for eid, fields in _entries(taken[1] if taken else []) + _stream(mine) + _stream(new):
            if fields and b"id" in fields:
                entries[eid] = _text(fields[b"id"])
        due = await self._pending_only(route, entries, limit)
        await self.sweep(route)
        return due

    async def sweep(self, route: str) -> list[str]:
        """Remove the route's other consumers that hold nothing and sat idle for ``idle_max``."""
        keys = [self.prefix + route]
        args: list[str | int] = [GROUP, int(self.idle_max * 1000), self.consumer]
        gone = await self._call(lambda c: self._sweep(keys=keys, args=args, client=c))
        return [_text(g) for g in gone or []]

    async def leave(self) -> int:
        """At a clean stop: remove this consumer from the routes it read from, where it holds
        no pending entry (those stay, for XAUTOCLAIM by another sidecar after the lease)."""
        if not self.joined:
            return 0
        keys = [self.prefix + r for r in sorted(self.joined)]
        args = [GROUP, self.consumer]
        return int(await self._call(lambda c: self._leave(keys=keys, args=args, client=c)))

    async def _pending_only(self, route: str, entries: dict[str, str], limit: int) -> Ids:
        order = sorted(entries, key=_entry_order)
        names = [self._rec(entries[e]) for e in order]

        async def states(c: Redis) -> Raw:
            async with c.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.hmget(name, "status", "entry")
                return await pipe.execute()

        got = await self._call(states) if names else []
        due: Ids = []
        stale: Ids = []
        for eid, (status, entry) in zip(order, got, strict=True):
            if status is not None and _text(status) == "pending" and entry and _text(entry) == eid:
                if entries[eid] not in due:
                    due.append(entries[eid])
            else:
                stale.append(eid)
        if stale:
            stream = self.prefix + route

            async def drop(c: Redis) -> None:
                async with c.pipeline(transaction=False) as pipe:
                    pipe.xack(stream, GROUP, *stale)
                    pipe.xdel(stream, *stale)
                    await pipe.execute()

            await self._call(drop)
        return due[:limit]


def _entry_order(eid: str) -> tuple[int, int]:
    ms, _, n = eid.partition("-")
    return int(ms), int(n or 0)


def _entries(raw: Any) -> list[tuple[str, dict[bytes, bytes] | None]]:
    """Stream entries as (id, fields); an entry deleted meanwhile has no fields."""
    out: list[tuple[str, dict[bytes, bytes] | None]] = []
    for item in raw or []:
        if item is None:
            continue
        eid, fields = item
        out.append((_text(eid), fields))
    return out


def _stream(reply: Any) -> list[tuple[str, dict[bytes, bytes] | None]]:
    """An ``XREADGROUP`` reply of one stream (a list, or a dict under RESP3)."""
    if not reply:
        return []
    if isinstance(reply, dict):
        return [e for v in reply.values() for e in _entries(v[0] if v else [])]
    return [e for _, entries in reply for e in _entries(entries)]

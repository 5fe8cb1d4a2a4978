"""Fleet kill switches (``fleet.killswitch: true``): switches shared by every sidecar of a Redis.

The fleet's truth is one Redis hash, ``<key_prefix>killswitches``: a field per scope, its value
the switch as JSON (scope, reason, set_by, set_on: the name of the sidecar it was set on,
set_at and expires_at as wall-clock epoch seconds). A set writes the field and publishes its
scope on ``<key_prefix>killswitches:changed``; a lift deletes it and publishes the same. Each
sidecar runs one background task (``fleet-switches``) that reads the whole hash every
``READ_EVERY`` second and at once when a message arrives, so a change reaches it within about a
second (at once with the message; at the latest with the next read, which also brings a sidecar
that was disconnected or started later up to date).

A set or a lift is one Lua script carrying a deadline on Redis's own clock: the call first reads
``TIME``, then sends the script with the instant, on Redis's clock, by which the sidecar still
waits for its answer (``deadline``: the call's timeout less what has passed and one round trip).
A script that Redis runs later (it was paused, or stalled, while the sidecar gave up and
answered 503 "nothing changed") refuses and changes nothing, so the 503 stays true. What
remains: a script run in time whose answer is lost or comes too late (a connection cut after it
ran) is reported as not done although it was; a set or lift again settles it.

A switch ends at its ``expires_at`` compared with the (injected) wall clock, so it expires on
every sidecar without one of them acting; the reader also deletes the expired fields it finds,
each only if it still holds the value judged expired (a compare-and-delete script), so a switch
set again in the meantime is never deleted by a reader that saw the old one.
While the Redis cannot be read, each sidecar keeps the switches it last knew (each still ends
at its own ``expires_at``) and ``connected`` says so.

The merge (``parse``, ``merge``) is pure; only ``FleetSwitches`` talks to Redis.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from sidecar.config.fleet import Fleet
from sidecar.core import Clock
from sidecar.fleet.connection import FleetLink, FleetUnavailable, cancellable
from sidecar.fleet.links import FleetLinks

if TYPE_CHECKING:
    from redis.asyncio import Redis
    from redis.asyncio.client import PubSub
    from redis.commands.core import AsyncScript

READ_EVERY = 1.0  # seconds between two reads of the shared hash
FLEET_USE = "killswitch"  # this use's link, as the fleet view names it
# KEYS: the hash; ARGV: the deadline on Redis's clock (seconds), the channel, the scope, the
# value. Nothing written once Redis's clock is past the deadline: the sidecar has given up.
_IN_TIME = """
local t = redis.call('TIME')
if tonumber(t[1]) + tonumber(t[2]) / 1000000 > tonumber(ARGV[1]) then
  return redis.error_reply('LATE the sidecar had given up waiting: nothing changed')
end
"""
_SET = (
    _IN_TIME
    + """
redis.call('HSET', KEYS[1], ARGV[3], ARGV[4])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return 1
"""
)
# ARGV: the deadline, the channel, the scope; returns the value deleted, or false.
_LIFT = (
    _IN_TIME
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[3])
redis.call('HDEL', KEYS[1], ARGV[3])
redis.call('PUBLISH', ARGV[2], ARGV[3])
return raw
"""
)
# KEYS: the hash; ARGV: field, value, field, value...: each field deleted only if it still holds
# the value the reader judged expired.
_PRUNE = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    n = n + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return n
"""
TASK = "fleet-switches"
log = logging.getLogger("sidecar.fleet")


@dataclass(frozen=True, slots=True)
class FleetSwitch:
    scope: str
    reason: str
    set_by: str  # the peer address that asked
    set_on: str  # the name of the sidecar it was set through
    set_at: float  # wall-clock epoch seconds
    expires_at: float  # wall-clock epoch seconds

    def encode(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()


def parse(raw: bytes) -> FleetSwitch | None:
    """One field's value, or None when it is not a switch this version understands."""
    try:
        d = json.loads(raw)
        sw = FleetSwitch(
            str(d["scope"]),
            str(d["reason"]),
            str(d["set_by"]),
            str(d["set_on"]),
            float(d["set_at"]),
            float(d["expires_at"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
    return sw


def merge(
    read: Mapping[bytes, bytes], wall: float
) -> tuple[dict[str, FleetSwitch], dict[bytes, bytes]]:
    """The shared hash as read: the switches in force at ``wall`` by scope, and the fields to
    delete (expired, or not a switch) with the values they were judged on."""
    live: dict[str, FleetSwitch] = {}
    stale: dict[bytes, bytes] = {}
    for field, raw in read.items():
        sw = parse(raw)
        if sw is None or sw.expires_at <= wall or sw.scope != field.decode(errors="replace"):
            stale[field] = raw
        else:
            live[sw.scope] = sw
    return live, stale


def in_force(known: Mapping[str, FleetSwitch], wall: float) -> list[FleetSwitch]:
    return [sw for sw in known.values() if sw.expires_at > wall]


def deadline(server_now: float, asked: float, answered: float, give_up: float) -> float:
    """The instant on Redis's clock past which a write must not run: Redis's clock read
    (``TIME`` = ``server_now``) between the local instants ``asked`` and ``answered``, and the
    local instant ``give_up`` at which the caller stops waiting. Redis's clock at ``give_up`` is
    at least ``server_now + (give_up - answered)``; one round trip less leaves the answer time
    to come back. Pure: the local instants are one monotonic clock's."""
    return server_now + (give_up - answered) - (answered - asked)


def sidecar_name() -> str:
    """Where a switch was set: the pod's name (``HOSTNAME``, as Kubernetes sets it), else the
    host's."""
    return os.environ.get("HOSTNAME") or socket.gethostname()


class FleetSwitches:
    """This sidecar's view of the fleet's switches, and its writes to them."""

    def __init__(self, link: FleetLink, clock: Clock, name: str) -> None:
        self.link = link
        self.name = name
        self.hash = f"{link.prefix}killswitches"
        self.channel = f"{link.prefix}killswitches:changed"
        self._clock = clock
        self._known: dict[str, FleetSwitch] = {}
        self._on_change: list[Callable[[], None]] = []
        self._wake = asyncio.Event()
        self._set = link.client.register_script(_SET)
        self._lift = link.client.register_script(_LIFT)
        self._prune = link.client.register_script(_PRUNE)

    @classmethod
    def of(cls, fleet: Fleet, clock: Clock, links: FleetLinks) -> FleetSwitches | None:
        """The fleet's switches when ``fleet.killswitch`` is on, else None; their link shown
        in ``links``."""
        if not fleet.killswitch:
            return None
        link = FleetLink(fleet.redis, clock, use=FLEET_USE)
        links.add(link, "the switches last known are kept; setting or lifting one is refused")
        return cls(link, clock, sidecar_name())

    @property
    def connected(self) -> bool:
        return self.link.connected

    def on_change(self, listener: Callable[[], None]) -> None:
        self._on_change.append(listener)

    def active(self, wall: float) -> list[FleetSwitch]:
        return in_force(self._known, wall)

    def any_known(self) -> bool:
        return bool(self._known)

    def _replace(self, known: dict[str, FleetSwitch]) -> None:
        added = any(self._known.get(scope) != sw for scope, sw in known.items())
        self._known = known
        if added:
            for listener in self._on_change:
                listener()

    async def _in_time(self, script: AsyncScript, args: list[bytes | str]) -> Any:
        """``script`` on the hash with ``args`` after its deadline and the channel, in one
        call; Redis runs it only while this sidecar still waits for the answer (see above)."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self.link.timeout  # the call's own timeout starts after this

        async def run(r: Redis) -> Any:
            asked = loop.time()
            seconds, micros = await r.time()
            answered = loop.time()
            until = deadline(seconds + micros / 1_000_000, asked, answered, give_up)
            head: list[bytes | str] = [repr(until), self.channel]
            return await script(keys=[self.hash], args=head + args, client=r)

        return await self.link.call(run)

    async def set(self, sw: FleetSwitch) -> None:
        """Store and announce ``sw``; ``FleetUnavailable`` when Redis cannot take it (then
        nothing changed, here or in Redis)."""
        await self._in_time(self._set, [sw.scope, sw.encode()])
        self._replace({**self._known, sw.scope: sw})

    async def lift(self, scope: str) -> bool:
        """Delete and announce the switch of ``scope``; whether the fleet had it in force."""
        raw = await self._in_time(self._lift, [scope])
        self._replace({s: sw for s, sw in self._known.items() if s != scope})
        sw = parse(raw) if raw is not None else None
        return sw is not None and sw.expires_at > self._clock.wall()

    async def read(self) -> None:
        """Read the shared hash and make it what this sidecar knows; delete expired fields.
        On failure what was known is kept (``FleetUnavailable``)."""

        async def read_all(r: Redis) -> dict[bytes, bytes]:
            got = await r.hgetall(self.hash)  # bytes: the client does not decode
            return {_b(k): _b(v) for k, v in got.items()}

        live, stale = merge(await self.link.call(read_all), self._clock.wall())
        if stale:
            pairs = [part for field, raw in stale.items() for part in (field, raw)]
            await self.link.call(lambda r: self._prune(keys=[self.hash], args=pairs, client=r))
        self._replace(live)

    async def run(self) -> None:
        """The ``fleet-switches`` task: read every ``READ_EVERY`` s and when told of a change;
        the subscription is made again after a failure. Ends by cancellation; closes the
        client on every way out."""
        pubsub: PubSub | None = None
        try:
            while True:
                try:
                    await self.read()
                except FleetUnavailable as exc:
                    log.debug("fleet kill switches not read: %s", exc)
                pubsub = await self._listen(pubsub)
        finally:
            if pubsub is not None:
                await _close(pubsub)
            await self.link.close()

    async def _listen(self, pubsub: PubSub | None) -> PubSub | None:
        """Wait up to ``READ_EVERY`` s for a change message; the subscription to use next."""
        try:
            if pubsub is None:
                pubsub = self.link.client.pubsub(ignore_subscribe_messages=True)
                async with asyncio.timeout(self.link.timeout):
                    await cancellable(pubsub.subscribe(self.channel))
            async with asyncio.timeout(READ_EVERY + self.link.timeout):
                await cancellable(pubsub.get_message(timeout=READ_EVERY))
            return pubsub
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("fleet kill switch subscription lost: %r", exc)
            if pubsub is not None:
                await _close(pubsub)
            await asyncio.sleep(min(READ_EVERY, self.link.backoff.delay() or READ_EVERY))
            return None


def _b(value: bytes | str) -> bytes:
    return value.encode() if isinstance(value, str) else value


async def _close(pubsub: PubSub) -> None:
    try:
        async with asyncio.timeout(1.0):
            await pubsub.aclose()  # type: ignore[no-untyped-call]
    except (Exception, TimeoutError):
        pass

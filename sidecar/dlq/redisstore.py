"""The fleet's DLQ: records in the Redis the sidecars share (``dlq: {backend: redis}``), so any
sidecar lists, shows, replays and purges any record, and a pod deleted or rescheduled strands
nothing.

Keys, under ``P = <fleet.redis.key_prefix>dlq:`` (a route name has no ``:``, so none collide):

- ``P<route>``: the route's stream, one entry ``{id: <record id>}`` per record waiting for the
  redrive; its consumer group ``redrive`` hands each entry to one sidecar at a time (each
  sidecar a consumer named ``<HOSTNAME>:<pid>``);
- ``Prec:<id>``: the record itself, a hash: the request (method, target, headers, body), what
  happened (fate, attempts, last status or error, replays, reached_upstream), its status, its
  replay claim (claimed_by, claimed_at, claim_expires_at), seq and its stream entry;
- ``Pidx:<route>:<status>``: the route's records of one status, a sorted set by seq (oldest
  first), for the listing, the figures and the oldest pending record;
- ``Pmeta:counts`` (kept records and bytes, fleet-wide, for ``max_records``/``max_bytes``; counts
  by status), ``Pmeta:seq``, ``Pmeta:routes``, ``Pmeta:delivered`` (delivered records by
  the time they were delivered, for the 24 h audit window), and ``Pmeta:epoch`` (a random
  value: a Redis that lost its data has another or none, ``redisepoch``).

Why a stream *and* a hash: the stream with its consumer group is the redrive's work list
(``XREADGROUP >`` for new entries, the consumer's own pending entries again each round while
they fail, ``XAUTOCLAIM`` after the claim lease for entries whose consumer died); the hash is
the record that a manual replay, a purge or a listing through any sidecar reads and changes.
The record's own claim (a compare-and-set on status and claim, in Lua, on Redis's clock) stays
the single guard against two sends at once, whoever asks: the redrive of another sidecar, an
operator's replay through any admin API. An entry is acknowledged and deleted when its record
is delivered, parked or purged.

``add`` is one script (``redisscripts.ADD``): the bounds checked (``DlqFull``), the hash
written, the entry added and the counts raised, atomically; the record is acknowledged (202 /
``x-retry-dlq: stored``) only once Redis answered it. Every call is bounded by
``fleet.redis.timeout`` (``FleetLink``); past it, or while the link leaves a failed Redis alone,
it is ``DlqUnavailable`` (``x-retry-dlq: unavailable``). A call cut off after it was sent (a
timeout, a cancellation) may still have been applied: an ``add`` then leaves a record nobody
was told of (delivered at least once: acceptable, never the other way round); a claim is left
to its lease, then taken over as a dead holder's is (marked possibly reached).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

from sidecar.dlq import rediscodec, redisepoch, redisscripts
from sidecar.dlq.contract import Ids, RouteCounts
from sidecar.dlq.counts import Counts
from sidecar.dlq.errors import (
    DlqFull,
    DlqUnavailable,
    RecordBusy,
    RecordDelivered,
    RecordNotFound,
    RecordNotInStatus,
)
from sidecar.dlq.operations import Finish, new_id
from sidecar.dlq.record import NewRecord
from sidecar.dlq.redisgroup import GROUP, RedriveGroup
from sidecar.fleet.connection import FleetLink, FleetUnavailable

if TYPE_CHECKING:
    from redis.asyncio import Redis

log = logging.getLogger("sidecar.dlq")

T = TypeVar("T")
Rows = list[dict[str, Any]]
Raw = list[Any]
STATUSES = ("pending", "parked", "delivered")
ID_TRIES = 5
PRUNE_BATCH = 500


def consumer_name() -> str:
    """This sidecar in the consumer group: its pod (``HOSTNAME``) and process."""
    host = os.environ.get("HOSTNAME") or socket.gethostname()
    return f"{host}:{os.getpid()}"


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class RedisDlqStore:
    """``DlqStorage`` in the fleet's Redis. Opening makes no connection (the first call does);
    ``close`` waits for the claim releases in flight, then closes the client."""

    def __init__(
        self,
        link: FleetLink,
        max_records: int,
        max_bytes: int,
        *,
        location: str = "redis",
        consumer: str | None = None,
    ) -> None:
        self._link = link
        self._location = location
        self.max_records = max_records
        self.max_bytes = max_bytes
        self.prefix = link.prefix + "dlq:"
        self.consumer = consumer or consumer_name()
        client = link.client
        self._add = client.register_script(redisscripts.ADD)
        self._claim = client.register_script(redisscripts.CLAIM)
        self._finish = client.register_script(redisscripts.FINISH)
        self._release = client.register_script(redisscripts.RELEASE)
        self._delete = client.register_script(redisscripts.DELETE)
        self._prune = client.register_script(redisscripts.PRUNE)
        self._epoch_read = client.register_script(redisepoch.READ)
        self._counts = Counts()
        self.group = RedriveGroup(client, self._call, self.prefix, self.consumer)
        self.epoch = redisepoch.Epoch(self.location)
        self.wall: Callable[[], float] = time.time  # the caller's clock (``prune_delivered``)
        self._releases: set[asyncio.Task[Any]] = set()
        self._closed = False

    # -- what the gauges and the page read -------------------------------------------------

    @property
    def link(self) -> FleetLink:
        return self._link

    @property
    def available(self) -> bool:
        return not self._closed and self._link.connected

    @property
    def counts(self) -> Counts:
        return self._counts

    @property
    def location(self) -> str:
        return f"{self._location} ({self.prefix}*)"

    def set_limits(self, max_records: int, max_bytes: int) -> None:
        """A reload: the bounds apply to the next record stored, fleet-wide (each sidecar
        checks the counts in Redis against its own config's bounds)."""
        self.max_records = max_records
        self.max_bytes = max_bytes

    def _rec(self, rid: str) -> str:
        return f"{self.prefix}rec:{rid}"

    def _idx(self, route: str, status: str) -> str:
        return f"{self.prefix}idx:{route}:{status}"

    async def _call(self, fn: Callable[[Redis], Awaitable[T]]) -> T:
        if self._closed:
            raise DlqUnavailable("the DLQ is closed")
        try:
            return await self._link.call(fn)
        except FleetUnavailable as exc:
            raise DlqUnavailable(str(exc)) from None

    # -- writes ------------------------------------------------------------------------------

    async def add(self, rec: NewRecord) -> str:
        for _ in range(ID_TRIES):
            rid = new_id(rec.created_at)
            args: list[bytes | str | int] = [
                self.prefix, GROUP, rid, rec.route,
                self.max_records, self.max_bytes, rec.size, redisepoch.fresh(),
                *rediscodec.encode(rid, rec),
            ]  # fmt: skip
            got = await self._call(self._adding(self._rec(rid), args))
            verdict = _text(got[0])
            self._epoch_seen(_text(got[-1]))
            if verdict == "ok":
                return rid
            if verdict == "full":
                bound = (
                    f"{self.max_records} records"
                    if _text(got[1]) == "records"
                    else f"{self.max_bytes} bytes"
                )
                raise DlqFull(f"the DLQ holds {bound} already")
        raise DlqUnavailable(f"no free record id in {ID_TRIES} draws")

    def _adding(
        self, key: str, args: builtins.list[bytes | str | int]
    ) -> Callable[[Redis], Awaitable[Any]]:
        return lambda c: self._add(keys=[key], args=args, client=c)

    def claim(
        self, rid: str, owner: str, statuses: Iterable[str], lease: float, now: float
    ) -> asyncio.Future[dict[str, Any]]:
        """The compare-and-set of ``contract.DlqStorage.claim`` in one script, judged on
        Redis's clock (``now`` is not used). Runs to its end in a task of its own whatever
        happens to the caller."""
        wanted = [s for s in statuses if s != "delivered"]
        return asyncio.ensure_future(self._take(rid, owner, wanted, lease))

    async def _take(self, rid: str, owner: str, wanted: list[str], lease: float) -> dict[str, Any]:
        key = self._rec(rid)
        args = [self.prefix, owner, repr(float(lease)), *wanted]
        got = await self._call(lambda c: self._claim(keys=[key], args=args, client=c))
        verdict = _text(got[0])
        if verdict == "ok":
            return rediscodec.full(rediscodec.pairs(got[1]))
        if verdict == "missing":
            raise RecordNotFound(f"no DLQ record {rid}")
        if verdict == "delivered":
            raise RecordDelivered(f"record {rid} was delivered already; it is not sent again")
        if verdict == "busy":
            raise RecordBusy(
                f"record {rid} is being replayed already (by {_text(got[1])}, "
                f"claim expires in {float(_text(got[2])):.0f}s)"
            )
        raise RecordNotInStatus(f"record {rid} is {_text(got[1])}, not {' or '.join(wanted)}")

    async def finish(self, rid: str, owner: str, fin: Finish, now: float) -> bool:
        key = self._rec(rid)
        args = [
            self.prefix, GROUP, rid, owner, fin.status,
            "1" if fin.count_replay else "0",
            "" if fin.last_status is None else str(fin.last_status),
            fin.last_error or "",
            "1" if fin.reached else "0",
            fin.parked_reason or "",
        ]  # fmt: skip
        done = await self._call(lambda c: self._finish(keys=[key], args=args, client=c))
        return bool(done)

    async def release(self, rid: str, owner: str, reached: bool) -> bool:
        key = self._rec(rid)
        args = [self.prefix, owner, "1" if reached else "0"]
        done = await self._call(lambda c: self._release(keys=[key], args=args, client=c))
        return bool(done)

    def release_soon(self, rid: str, owner: str, reached: bool) -> None:
        """Give a claim back in a task of its own (the caller was cancelled half-way); a
        release that fails leaves the claim to its lease. ``close`` waits for it."""
        if self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._release_logged(rid, owner, reached))
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def _release_logged(self, rid: str, owner: str, reached: bool) -> None:
        try:
            await self.release(rid, owner, reached)
        except DlqUnavailable as exc:
            log.warning("giving back a DLQ replay claim failed (it will expire): %s", exc)

    async def delete(self, rid: str, now: float | None = None) -> bool:
        """Purge one record (on Redis's clock: ``now`` is not used)."""
        key = self._rec(rid)
        args = [self.prefix, GROUP, rid]
        got = await self._call(lambda c: self._delete(keys=[key], args=args, client=c))
        if isinstance(got, list):
            raise RecordBusy(f"record {rid} is being replayed (by {_text(got[1])})")
        return bool(got)

    async def prune_delivered(self, older_than: float) -> int:
        """Judged on Redis's clock: records delivered longer ago than the caller's window
        (``older_than`` on its clock is only how long ago that is)."""
        total = 0
        age = repr(max(0.0, self.wall() - older_than))
        args: builtins.list[str | int] = [self.prefix, GROUP, age, PRUNE_BATCH]
        while True:
            n = int(await self._call(lambda c: self._prune(keys=[], args=args, client=c)))
            total += n
            if n < PRUNE_BATCH:
                return total

    # -- reads -------------------------------------------------------------------------------

    async def _routes(self) -> list[str]:
        members = await self._call(lambda c: c.smembers(self.prefix + "meta:routes"))
        return sorted(_text(m) for m in members)

    async def list(
        self,
        route: str | None = None,
        status: str | None = None,
        limit: int = 50,
        newest_first: bool = True,
        cursor: int | None = None,
    ) -> tuple[list[dict[str, Any]], int | None]:
        routes = [route] if route else await self._routes()
        keys = [self._idx(r, s) for r in routes for s in ((status,) if status else STATUSES)]
        if newest_first:
            hi, lo = ("(" + str(cursor)) if cursor is not None else "+inf", "-inf"
        else:
            lo, hi = ("(" + str(cursor)) if cursor is not None else "-inf", "+inf"

        async def ranges(c: Redis) -> Raw:
            async with c.pipeline(transaction=False) as pipe:
                for k in keys:
                    if newest_first:
                        pipe.zrevrangebyscore(k, hi, lo, start=0, num=limit + 1, withscores=True)
                    else:
                        pipe.zrangebyscore(k, lo, hi, start=0, num=limit + 1, withscores=True)
                return await pipe.execute()

        got_ranges = await self._call(ranges) if keys else []
        found = [(int(score), _text(rid)) for got in got_ranges for rid, score in got]
        found.sort(reverse=newest_first)
        page = found[: limit + 1]
        records = await self._records([rid for _, rid in page[:limit]], full=False)
        nxt = page[limit - 1][0] if len(page) > limit else None
        return records, nxt

    async def _records(self, ids: Ids, *, full: bool) -> Rows:
        if not ids:
            return []
        names = [self._rec(rid) for rid in ids]

        async def read(c: Redis) -> Raw:
            async with c.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.hgetall(name)
                return await pipe.execute()

        decode = rediscodec.full if full else rediscodec.summary
        return [decode(f) for f in await self._call(read) if f]  # purged meanwhile: skipped

    async def get(self, rid: str) -> dict[str, Any] | None:
        got = await self._records([rid], full=True)
        return got[0] if got else None

    async def route_counts(self) -> RouteCounts:
        routes = await self._routes()
        wanted = [(s, r) for r in routes for s in ("pending", "parked")]

        async def heads(c: Redis) -> Raw:
            async with c.pipeline(transaction=False) as pipe:
                for s, r in wanted:
                    pipe.zcard(self._idx(r, s))
                    pipe.zrange(self._idx(r, s), 0, 0)
                return await pipe.execute()

        got = await self._call(heads) if wanted else []
        rows: builtins.list[tuple[str, str, int, str]] = []
        for i, (s, r) in enumerate(wanted):
            n, first = int(got[2 * i]), got[2 * i + 1]
            if n and first:
                rows.append((s, r, n, _text(first[0])))
        created = await self._created([rid for *_, rid in rows])
        return [(s, r, n, created.get(rid, 0.0)) for s, r, n, rid in rows]

    async def _created(self, ids: Ids) -> dict[str, float]:
        if not ids:
            return {}
        names = [self._rec(rid) for rid in ids]

        async def read(c: Redis) -> Raw:
            async with c.pipeline(transaction=False) as pipe:
                for name in names:
                    pipe.hget(name, "created_at")
                return await pipe.execute()

        values = await self._call(read)
        return {rid: float(_text(v)) for rid, v in zip(ids, values, strict=True) if v}

    async def refresh(self) -> None:
        """Publish the fleet-wide counts and the oldest pending record for the gauges, and
        check the epoch (``redisepoch``)."""
        keys, args = [self.prefix + "meta:epoch"], [redisepoch.fresh()]
        seen = await self._call(lambda c: self._epoch_read(keys=keys, args=args, client=c))
        self._epoch_seen(_text(seen))
        raw = await self._call(lambda c: c.hgetall(self.prefix + "meta:counts"))
        by_status = {s: 0 for s in STATUSES}
        for k, v in raw.items():
            name = _text(k)
            if name.startswith("status:"):
                by_status[name[7:]] = int(_text(v))
        pending = [created for s, _, _, created in await self.route_counts() if s == "pending"]
        self._counts = Counts(by_status, min(pending) if pending else None)

    def _epoch_seen(self, value: str) -> None:
        if self.epoch.seen(value):
            self.group.forget()  # the groups went with the data

    # -- the redrive's work list -------------------------------------------------------------

    async def due(self, route: str, limit: int, idle: float) -> Ids:
        """The route's entries for this sidecar's consumer (``redisgroup.RedriveGroup.due``)."""
        return await self.group.due(route, limit, idle)

    # -- lifecycle ---------------------------------------------------------------------------

    async def close(self) -> None:
        """The claim releases in flight get one timeout to finish, this consumer leaves the
        groups where it holds nothing (``RedriveGroup.leave``), then the client closes."""
        if self._releases:
            await asyncio.wait(set(self._releases), timeout=2 * self._link.timeout)
        for task in list(self._releases):
            task.cancel()
        try:
            if not self._closed:
                await self.group.leave()
        except DlqUnavailable as exc:
            log.warning("the DLQ's redrive consumer could not leave its groups: %s", exc)
        finally:  # cancelled half-way too: the client is closed
            self._closed = True
            with contextlib.suppress(Exception):
                await self._link.close()

"""Replaying DLQ records through the route's current policy, and the automatic redrive.

A replay is the stored request sent through the same sequence runner as live traffic (breaker,
budget, bulkhead, retries), with the same Idempotency-Key and ``x-retry-replay: <id>``.
Delivery is at-least-once: an upstream may have applied a write whose answer was lost, so
upstreams should honour the Idempotency-Key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sidecar.config.model import Config
from sidecar.core import UpstreamError
from sidecar.dlq.store import DlqStore
from sidecar.engine.deps import EngineDeps
from sidecar.engine.sequence import Exchange, Sequence
from sidecar.retry.breaker import State
from sidecar.retry.deadline import Deadline
from sidecar.upstream.client import UpstreamResponse

log = logging.getLogger("sidecar.dlq")

DELIVERED_RETENTION = 24 * 3600.0  # delivered records are kept this long for audit
DRAIN_TIMEOUT = 30.0


class ReplayBusy(Exception):
    pass


class ReplayNotFound(Exception):
    pass


class ReplayRouteGone(Exception):
    pass


@dataclass(frozen=True, slots=True)
class ReplayOutcome:
    id: str
    status: str  # the record's status after the replay
    http_status: int | None
    fate: str
    attempts: int

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "status": self.status,
            "http_status": self.http_status,
            "fate": self.fate,
            "attempts": self.attempts,
        }


class Replayer:
    def __init__(
        self,
        store: DlqStore,
        deps: EngineDeps,
        config: Callable[[], Config],
    ) -> None:
        self.store = store
        self.deps = deps
        self._config = config
        self.in_progress: set[str] = set()
        self._next_slot: dict[str, float] = {}

    async def _pace(self, route: str, rate: float) -> None:
        """At most ``rate`` replays per second per route."""
        now = time.monotonic()
        slot = max(now, self._next_slot.get(route, 0.0))
        self._next_slot[route] = slot + 1.0 / rate
        if slot > now:
            await asyncio.sleep(slot - now)

    async def replay_one(self, rid: str) -> ReplayOutcome:
        if rid in self.in_progress:
            raise ReplayBusy(f"record {rid} is being replayed already")
        self.in_progress.add(rid)
        try:
            return await self._replay(rid)
        finally:
            self.in_progress.discard(rid)

    async def _replay(self, rid: str) -> ReplayOutcome:
        rec = await self.store.get(rid)
        if rec is None:
            raise ReplayNotFound(f"no DLQ record {rid}")
        config = self._config()
        route = config.route(rec["route"])
        if route is None:
            raise ReplayRouteGone(f"route {rec['route']} is no longer configured")
        await self._pace(route.name, route.dlq.replay_rate)
        body: bytes = rec["body_bytes"]
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in rec["headers"]]
        headers.append((b"x-retry-replay", rid.encode()))
        if body or rec["method"] in ("POST", "PUT", "PATCH"):
            headers.append((b"Content-Length", str(len(body)).encode()))
        clock = self.deps.clock
        ex = Exchange(
            route=route,
            method=rec["method"],
            target=rec["target"],
            headers=headers,
            body=body,
            chunked=False,
            replayable=True,
            edge=None,
            deadline=Deadline.start(clock.monotonic(), route.timeout),
            idempotency_key=rec["idempotency_key"] is not None,
        )
        http_status: int | None = None
        error: str | None = None
        async with Sequence(self.deps, config.name.encode(), ex) as seq:
            result = seq.result
            if result is None:
                fate, attempts, error = "breaker-open", 0, "breaker open"
            else:
                fate, attempts = result.fate.value, result.attempts
                if result.response is not None:
                    http_status = result.response.status
                    if not await _drain(result.response, route.retry.per_try_timeout):
                        seq.body_failed()
                elif result.error is not None:
                    error = str(result.error)
        replays = int(rec["replays"]) + (1 if attempts > 0 else 0)
        if http_status is not None and http_status < 400:
            status = "delivered"
        elif http_status is not None and http_status < 500:
            status = "parked"  # the upstream's answer: replaying again will not change it
        elif replays >= route.dlq.max_replays:
            status = "parked"
        else:
            status = "pending"
        await self.store.set_status(
            rid, status, count_replay=attempts > 0, last_status=http_status, last_error=error
        )
        log.info(
            "DLQ replay of %s on route %s: %s (%s, http %s)",
            rid,
            route.name,
            status,
            fate,
            http_status,
        )
        return ReplayOutcome(rid, status, http_status, fate, attempts)

    async def replay_batch(
        self, route: str | None, status: str, limit: int, dry_run: bool
    ) -> dict[str, Any]:
        rows, _ = await self.store.list(route=route, status=status, limit=limit, newest_first=False)
        ids = [r["id"] for r in rows if r["id"] not in self.in_progress]
        if dry_run:
            return {"dry_run": True, "would_replay": ids}
        results = []
        for rid in ids:
            try:
                results.append((await self.replay_one(rid)).as_json())
            except (ReplayBusy, ReplayNotFound, ReplayRouteGone) as exc:
                results.append({"id": rid, "error": str(exc)})
        return {"dry_run": False, "replayed": results}

    # -- background work ------------------------------------------------------------------

    async def redrive_loop(self) -> None:
        """Replay pending records oldest first, per route with redrive enabled, while that
        route's breaker is closed."""
        last_run: dict[str, float] = {}
        while True:
            await asyncio.sleep(1.0)
            config = self._config()
            for route in config.routes:
                rd = route.dlq.redrive
                if not (route.dlq.enabled and rd.enabled):
                    continue
                now = time.monotonic()
                if now - last_run.get(route.name, 0.0) < rd.interval:
                    continue
                last_run[route.name] = now
                await self._redrive_route(route.name)

    async def _redrive_route(self, name: str) -> None:
        state = self.deps.states.get(name)
        rows, _ = await self.store.list(route=name, status="pending", limit=100, newest_first=False)
        for r in rows:
            if state.breaker.state is not State.CLOSED or self.deps.life.draining:
                return
            try:
                await self.replay_one(r["id"])
            except (ReplayBusy, ReplayNotFound, ReplayRouteGone):
                continue

    async def prune_loop(self) -> None:
        while True:
            await asyncio.sleep(60.0)
            try:
                n = await self.store.prune_delivered(time.time() - DELIVERED_RETENTION)
                if n:
                    log.info("pruned %d delivered DLQ records past the audit window", n)
            except Exception as exc:  # keep pruning later; the proxy keeps serving
                log.warning("DLQ prune failed: %s", exc)


async def _drain(response: UpstreamResponse, idle: float) -> bool:
    """Read the replayed response to its end; False if the upstream broke mid-body."""
    try:
        while await response.read_chunk(idle):
            pass
    except UpstreamError:
        response.discard()
        return False
    response.release()
    return True

"""Replaying DLQ records through the route's current policy.

A replay is the stored request sent through the same sequence runner as live traffic (breaker,
budget, bulkhead, retries), with the same Idempotency-Key and ``x-retry-replay: <id>``.
Delivery is at-least-once: an upstream may have applied a write whose answer was lost, so
upstreams should honour the Idempotency-Key.

Ownership: a replay first claims its record in the store (``DlqStore.claim``, a compare-and-set
in the file), so that nothing else -- another replay, the redrive, another process sharing the
file -- sends it meanwhile, and a delivered record is never claimed again. The claim is given
back on every exit: with the outcome when the replay ends, or as a bare release (marking the
record as possibly sent) when the replay is cancelled half-way. A claim is a lease of
``route.timeout + EXECUTE_SLACK + DRAIN_LIMIT + LEASE_MARGIN`` (45 s more than the route's
deadline): the sequence is cut at ``route.timeout + EXECUTE_SLACK`` and the response body at
``DRAIN_LIMIT``, so a live process finishes well before its lease ends, and a process that dies
leaves a claim that anyone may take over once it expired.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from sidecar.config.model import Config, Route
from sidecar.core import Fate, LocalOverload, UpstreamError
from sidecar.dlq.capture import reached_upstream
from sidecar.dlq.contract import DlqStorage
from sidecar.dlq.errors import ClaimRefused, DlqError, RecordNotFound
from sidecar.dlq.operations import Finish
from sidecar.dlq.record import safe_to_resend
from sidecar.engine.deps import EngineDeps
from sidecar.engine.loop import SequenceResult
from sidecar.engine.sequence import Exchange, Sequence
from sidecar.retry.breaker import State
from sidecar.retry.deadline import Deadline
from sidecar.upstream.client import UpstreamResponse

log = logging.getLogger("sidecar.dlq")

DELIVERED_RETENTION = 24 * 3600.0  # delivered records are kept this long for audit
EXECUTE_SLACK = 5.0  # a replay's sequence is cut this long after its route's deadline
DRAIN_LIMIT = 10.0  # a replay's response body is read (and dropped) for at most this long
LEASE_MARGIN = 30.0  # a claim outlives its replay's own time limits by this much
FINISH_TRIES = (0.2, 1.0, 3.0)  # pauses between tries to record an outcome the disk refused
UNSAFE = (
    "not resent automatically: it may have reached the upstream, and the route's "
    "non_idempotent rule does not allow resending it (no Idempotency-Key); replay it by hand "
    "once you know it was not applied"
)


class ReplayRouteGone(ClaimRefused):
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


def new_owner() -> str:
    """Who holds a claim: host, process and a random part (a restarted process with the same
    pid is someone else)."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


def lease_for(route: Route) -> float:
    return route.timeout + EXECUTE_SLACK + DRAIN_LIMIT + LEASE_MARGIN


def next_status(http_status: int | None, replays: int, max_replays: int) -> tuple[str, str | None]:
    """Where a record goes after a replay that was sent: (status, parked_reason). Pure."""
    if http_status is not None and http_status < 400:
        return "delivered", None
    if http_status is not None and http_status < 500:
        # The upstream's own answer: replaying again will not change it.
        return "parked", f"the upstream answered {http_status}"
    if replays >= max_replays:
        return "parked", f"max_replays ({max_replays}) reached"
    return "pending", None


class Replayer:
    def __init__(
        self,
        store: DlqStorage,
        deps: EngineDeps,
        config: Callable[[], Config],
        owner: str | None = None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.deps = deps
        self._config = config
        self.owner = owner or new_owner()
        self._wall = wall
        self._next_slot: dict[str, float] = {}

    async def _pace(self, route: str, rate: float) -> None:
        """At most ``rate`` replays per second per route (in this process)."""
        now = time.monotonic()
        slot = max(now, self._next_slot.get(route, 0.0))
        self._next_slot[route] = slot + 1.0 / rate
        if slot > now:
            await asyncio.sleep(slot - now)

    async def replay_one(
        self,
        rid: str,
        statuses: Iterable[str] = ("pending", "parked"),
        automatic: bool = False,
    ) -> ReplayOutcome:
        """Claim, send and record one record. ``automatic`` (the redrive) sends only what is
        safe to resend and parks the rest. Raises ClaimRefused subclasses when the record is
        gone, delivered, claimed by another replay or not in ``statuses``; DlqError when the
        store fails."""
        rec = await self.store.get(rid)
        if rec is None:
            raise RecordNotFound(f"no DLQ record {rid}")
        route = self._config().route(rec["route"])
        if route is None:
            raise ReplayRouteGone(f"route {rec['route']} is no longer configured")
        await self._pace(route.name, route.dlq.replay_rate)
        claimed = await self._claim(rid, statuses, lease_for(route))
        sent = False
        settled = False  # the outcome is being recorded: no bare release any more
        try:
            key = claimed["idempotency_key"]
            if automatic and not safe_to_resend(
                route.retry, claimed["method"], key, claimed["reached_upstream"]
            ):
                outcome = ReplayOutcome(rid, "parked", None, "not-sent", 0)
                fin = Finish(
                    "parked", False, claimed["last_status"], claimed["last_error"], False, UNSAFE
                )
            else:
                sent = True  # a cancellation from here on may leave bytes at the upstream
                outcome, fin = await self._send(route, claimed, automatic)
            # The finish is queued even if this task is cancelled while awaiting it; if the
            # disk refuses it for good, the claim is left to expire rather than released
            # without its outcome (a delivery that was not recorded must not be resent early).
            settled = True
            await self._record(rid, fin, outcome)
        finally:
            if not settled:
                self.store.release_soon(rid, self.owner, sent)
        log.info(
            "DLQ replay of %s on route %s: %s (%s, http %s)",
            rid,
            route.name,
            outcome.status,
            outcome.fate,
            outcome.http_status,
        )
        return outcome

    async def _claim(self, rid: str, statuses: Iterable[str], lease: float) -> dict[str, Any]:
        fut = self.store.claim(rid, self.owner, statuses, lease, self._wall())
        try:
            # Shielded: the claim commits whatever happens to this task, so a cancelled
            # caller must still give back what it was granted.
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: self._release_granted(rid, f))
            raise

    def _release_granted(self, rid: str, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self.store.release_soon(rid, self.owner, False)

    async def _send(
        self, route: Route, rec: dict[str, Any], automatic: bool
    ) -> tuple[ReplayOutcome, Finish]:
        rid: str = rec["id"]
        body: bytes = rec["body_bytes"]
        method: str = rec["method"]
        has_key = bool((rec["idempotency_key"] or "").strip())
        headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in rec["headers"]]
        headers.append((b"x-retry-replay", rid.encode()))
        if body or method in ("POST", "PUT", "PATCH"):
            headers.append((b"Content-Length", str(len(body)).encode()))
        clock = self.deps.clock
        if self.deps.kill.covers(route.name, clock.monotonic()):
            # A killed sequence skips the breaker (one plain attempt), so a replay under a
            # switch must never be what gets past a breaker that is not closed. The redrive is
            # automatic retrying, which the switch turns off: it sends nothing. A replay asked
            # by hand is sent as live traffic is under the switch (one attempt), and only while
            # the breaker is closed. Otherwise the record stays as it was, no replay counted.
            # No await from here to the Sequence below, which reads the switch as it starts.
            if automatic:
                return self._untouched(rec, Fate.KILL_SWITCH, 0)
            if self.deps.states.get(route.name).breaker.state is not State.CLOSED:
                return self._untouched(rec, Fate.BREAKER_OPEN, 0)
        if self.deps.life.draining:
            return self._untouched(rec, Fate.DRAINING, 0)  # no replay starts in a drain
        ex = Exchange(
            route=route,
            method=method,
            target=rec["target"],
            headers=headers,
            body=body,
            chunked=False,
            replayable=True,
            edge=None,
            deadline=Deadline.start(clock.monotonic(), route.timeout),
            idempotency_key=has_key,
        )
        config_name = self._config().name.encode()
        result: SequenceResult | None = None  # stays None when the breaker refused
        http_status: int | None = None
        try:
            async with (
                asyncio.timeout(route.timeout + EXECUTE_SLACK + DRAIN_LIMIT),
                Sequence(self.deps, config_name, ex) as seq,
            ):
                result = seq.result
                if result is not None and result.response is not None:
                    http_status = result.response.status
                    if not await _drain(result.response, route.stream_idle_timeout):
                        seq.body_failed()  # the upstream broke mid-body
        except TimeoutError:
            if http_status is None:  # no answer in time (an answer's status stands)
                fin = self._after_send(rec, route, None, "the replay ran out of time", True)
                return ReplayOutcome(rid, fin.status, None, Fate.DEADLINE.value, 1), fin
        if result is None or result.attempts == 0 or isinstance(result.error, LocalOverload):
            # Nothing was tried (breaker refused, no room, no time left): the record stays as
            # it was, and no replay is counted.
            if result is None:
                return self._untouched(rec, Fate.BREAKER_OPEN, 0)
            return self._untouched(rec, result.fate, result.attempts)
        reached = reached_upstream(result)
        error = str(result.error) if result.error is not None else None
        fin = self._after_send(rec, route, http_status, error, reached)
        return ReplayOutcome(rid, fin.status, http_status, result.fate.value, result.attempts), fin

    def _untouched(
        self, rec: dict[str, Any], fate: Fate, attempts: int
    ) -> tuple[ReplayOutcome, Finish]:
        """A replay that sent nothing: the record keeps its status, no replay is counted."""
        fin = Finish(
            rec["status"], False, rec["last_status"], rec["last_error"], False,
            rec["parked_reason"],
        )  # fmt: skip
        return ReplayOutcome(rec["id"], rec["status"], None, fate.value, attempts), fin

    def _after_send(
        self,
        rec: dict[str, Any],
        route: Route,
        http_status: int | None,
        error: str | None,
        reached: bool,
    ) -> Finish:
        replays = int(rec["replays"]) + 1
        status, reason = next_status(http_status, replays, route.dlq.max_replays)
        return Finish(status, True, http_status, error, reached, reason)

    async def _record(self, rid: str, fin: Finish, outcome: ReplayOutcome) -> None:
        """Record the outcome and give the claim back. A disk that refuses is tried again a
        few times: forgetting a delivery would let it be sent again after the lease."""
        for pause in (*FINISH_TRIES, None):
            try:
                if not await self.store.finish(rid, self.owner, fin, self._wall()):
                    log.error(
                        "DLQ record %s: the claim was lost before the replay ended (purged, or "
                        "its lease expired and another replay took it); outcome %s not recorded",
                        rid,
                        outcome.status,
                    )
                return
            except DlqError as exc:
                if pause is None:
                    log.error(
                        "DLQ record %s: replay outcome %s (http %s) could not be recorded: %s; "
                        "the record stays claimed until its lease expires",
                        rid,
                        outcome.status,
                        outcome.http_status,
                        exc,
                    )
                    raise
                await asyncio.sleep(pause)

    async def replay_batch(
        self, route: str | None, status: str, limit: int, dry_run: bool
    ) -> dict[str, Any]:
        rows, _ = await self.store.list(route=route, status=status, limit=limit, newest_first=False)
        now = self._wall()
        ids = [
            r["id"]
            for r in rows
            if r["claimed_by"] is None or (r["claim_expires_at"] or 0.0) <= now
        ]
        if dry_run:
            return {"dry_run": True, "would_replay": ids}
        results: list[dict[str, Any]] = []
        for rid in ids:
            try:
                results.append((await self.replay_one(rid, statuses=(status,))).as_json())
            except ClaimRefused as exc:
                results.append({"id": rid, "error": str(exc)})
            except DlqError as exc:
                results.append({"id": rid, "error": str(exc)})
                break  # the store is failing: stop here, report what was done
        return {"dry_run": False, "replayed": results}


async def _drain(response: UpstreamResponse, idle: float) -> bool:
    """Read the replay's response to its end (so its connection can be reused), for at most
    DRAIN_LIMIT; the status is what counts, the body is dropped. False if the upstream broke
    mid-body. On any other early exit the sequence's scope discards the response."""
    try:
        async with asyncio.timeout(DRAIN_LIMIT):
            while await response.read_chunk(idle):
                pass
    except UpstreamError:
        response.discard()
        return False
    except TimeoutError:
        response.discard()
        return True
    response.release()
    return True

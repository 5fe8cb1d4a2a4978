"""The DLQ's background work: the automatic redrive and the pruning of delivered records.

Redrive replays a route's pending records, oldest first, every ``redrive.interval``. It sends
only what is safe to resend without a human (see ``record.safe_to_resend``) and parks the rest.
It goes through the breaker like any sequence: while the breaker is open each round offers one
replay, which the breaker refuses until ``open_for`` has passed and then admits as a half-open
probe -- so a route whose clients went quiet still recovers, with replays as its probes. A round
stops at the first refusal.

Neither loop dies of a failure: a storage error (or any bug) is logged, the route's next round
is pushed back (doubling up to ``MAX_BACKOFF``), and the loop goes on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sidecar.config.model import Config
from sidecar.core import Fate
from sidecar.dlq.contract import DlqStorage
from sidecar.dlq.errors import ClaimRefused
from sidecar.dlq.replay import DELIVERED_RETENTION, Replayer, lease_for
from sidecar.lifecycle import Lifecycle

log = logging.getLogger("sidecar.dlq")

TICK = 1.0  # how often the loop looks for a route that is due
BATCH = 100  # records looked at per route and round
MAX_BACKOFF = 300.0
PRUNE_EVERY = 60.0
STOPS_A_ROUND = (Fate.BREAKER_OPEN.value, Fate.KILL_SWITCH.value)


def next_run(now: float, interval: float, failures: int) -> float:
    """When a route's next round is due: ``interval`` after a good round, doubling (up to
    MAX_BACKOFF, never below ``interval``) after each failed one. Pure."""
    if failures <= 0:
        return now + interval
    return now + max(interval, min(MAX_BACKOFF, interval * 2.0**failures))


class Redrive:
    def __init__(
        self,
        replayer: Replayer,
        config: Callable[[], Config],
        life: Lifecycle,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.replayer = replayer
        self._config = config
        self._life = life
        self._monotonic = monotonic
        self._due: dict[str, float] = {}
        self.failures: dict[str, int] = {}  # consecutive failed rounds, per route
        self.paused: set[str] = set()  # routes a kill switch covers (logged once)

    async def run(self) -> None:
        while True:
            await self._life.sleep(TICK)  # a drain ends it at once
            if self._life.draining:
                return  # no replay starts once the sidecar drains (a round stops likewise)
            for route in self._config().routes:
                rd = route.dlq.redrive
                if not (route.dlq.enabled and rd.enabled):
                    continue
                now = self._monotonic()
                if now < self._due.get(route.name, 0.0) or not self._may_send(route.name):
                    continue
                try:
                    await self.round(route.name)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    n = self.failures.get(route.name, 0) + 1
                    self.failures[route.name] = n
                    self._due[route.name] = next_run(self._monotonic(), rd.interval, n)
                    log.error(
                        "DLQ redrive of route %s failed (%d in a row; next try in %.0fs): %s",
                        route.name,
                        n,
                        self._due[route.name] - self._monotonic(),
                        exc,
                    )
                else:
                    if self.failures.pop(route.name, 0):
                        log.info("DLQ redrive of route %s works again", route.name)
                    self._due[route.name] = next_run(self._monotonic(), rd.interval, 0)

    async def round(self, route: str) -> None:
        conf = self._config().route(route)
        if conf is None:
            return
        for rid in await self.replayer.store.due(route, BATCH, lease_for(conf)):
            if self._life.draining or not self._may_send(route):
                return  # asked before every record: a switch, a drain or a reload stops it
            try:
                outcome = await self.replayer.replay_one(rid, statuses=("pending",), automatic=True)
            except ClaimRefused:
                continue  # delivered, claimed or purged meanwhile: someone else has it
            if outcome.fate in STOPS_A_ROUND:
                return  # the breaker is not letting anything through yet, or a switch is set

    def _may_send(self, route: str) -> bool:
        """Whether the redrive may send the route's records now: the current config still
        has its redrive on, and no kill switch covers it (a kill switch stops retries, and a
        redrive is retries; it never sends more). A pause is logged when it starts and ends."""
        conf = self._config().route(route)
        if conf is None or not (conf.dlq.enabled and conf.dlq.redrive.enabled):
            return False
        deps = self.replayer.deps
        killed = deps.kill.covers(route, deps.clock.monotonic())
        if killed and route not in self.paused:
            self.paused.add(route)
            log.warning("DLQ redrive of route %s paused: a kill switch covers it", route)
        elif not killed and route in self.paused:
            self.paused.discard(route)
            log.info("DLQ redrive of route %s resumed: no kill switch covers it", route)
        return not killed


async def prune(store: DlqStorage) -> None:
    """Delete delivered records past the audit window, every minute, whatever fails."""
    while True:
        await asyncio.sleep(PRUNE_EVERY)
        try:
            n = await store.prune_delivered(time.time() - DELIVERED_RETENTION)
            if n:
                log.info("pruned %d delivered DLQ records past the audit window", n)
        except Exception as exc:  # keep pruning later; the proxy keeps serving
            log.warning("DLQ prune failed: %s", exc)

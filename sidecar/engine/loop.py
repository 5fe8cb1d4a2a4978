"""The async driver of one retry sequence: attempt, classify, decide, sleep, hedge, repeat.

All judgement lives in pure functions (``decide``, the throttle, the budgets, the endpoint
choice, the per-try timeout estimate); this module only does I/O and waiting, reading time from
an injected clock so that drain can cut a backoff sleep short.

Two shapes of sequence:

- one attempt at a time (most): each attempt runs in the caller's task, no timer;
- hedged (an idempotent request with a buffered body, ``per_try_timeout: auto`` and hedging on):
  attempts are tasks owned by an ``AttemptSet``. When the newest attempt has run for the
  per-try timeout without an answer, another starts beside it (if the hedging budget, the
  throttle and the concurrency limit allow), preferably to another endpoint; the first usable
  answer wins and the scope cancels the others. A retryable failure while another attempt is
  still running just waits for that one; when none is left, ``decide`` chooses as usual.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Protocol

from sidecar.config.model import Route
from sidecar.core import (
    AttemptTimeout,
    Clock,
    Fate,
    LocalOverload,
    NoTimeLeft,
    OutcomeKind,
    UpstreamError,
)
from sidecar.engine.attempts import Attempted, AttemptSet
from sidecar.retry.backoff import Rng
from sidecar.retry.classify import Outcome, is_retryable
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints, Decision, Retry, Stop, decide
from sidecar.retry.endpoints import Endpoint
from sidecar.telemetry.events import EventSink, HedgeEvent, RetryScheduled
from sidecar.upstream.client import UpstreamResponse


class RetryGate(Protocol):
    """Asked during a sequence: kill switch, budget and throttle, drain; does the sleeping."""

    def killed(self) -> bool: ...

    def allow_retry(self) -> Fate | None:
        """None when a retry may go; else the fate that stops the sequence."""
        ...

    def allow_hedge(self) -> str | None:
        """None when a hedge may go; else why not (``budget``, ``throttle``)."""
        ...

    def draining(self) -> bool: ...

    async def sleep(self, delay: float) -> None: ...


class Attempter(Protocol):
    """Makes one attempt: endpoint choice, concurrency ticket, the wire, the bookkeeping.

    ``attempt`` never raises for an upstream failure or a local refusal: it returns them in
    ``Attempted``."""

    def hedge_after(self) -> float | None:
        """Seconds after an attempt starts when it is hedged; None: this sequence never is."""
        ...

    def has_room(self) -> bool: ...

    def pick(self, avoid: Sequence[Endpoint]) -> Endpoint: ...

    def attempt(
        self, number: int, hedge: bool, endpoint: Endpoint, timeout: float
    ) -> Awaitable[Attempted]: ...


@dataclass(slots=True)
class SequenceResult:
    fate: Fate
    attempts: int
    response: UpstreamResponse | None = None
    error: UpstreamError | LocalOverload | None = None
    hedges: int = 0
    outcome: Outcome | None = None  # of the attempt whose answer stands

    @property
    def response_status(self) -> int | None:
        return self.response.status if self.response is not None else None


def outcome_of(response: UpstreamResponse, refused_below: Fate | None = None) -> Outcome:
    ra = response.header(b"retry-after")
    return Outcome(
        OutcomeKind.RESPONSE,
        status=response.status,
        retry_after=ra.decode("latin-1") if ra is not None else None,
        refused_below=refused_below,
    )


def _result(fate: Fate, number: int, a: Attempted | None, hedges: int) -> SequenceResult:
    if a is None:
        return SequenceResult(fate, number, None, None, hedges)
    return SequenceResult(fate, number, a.response, a.error, hedges, a.outcome)


class _Driver:
    """The state of one sequence's decisions (kept out of the coroutine's locals so the two
    shapes share it)."""

    __slots__ = (
        "attempter",
        "c",
        "clock",
        "deadline",
        "events",
        "gate",
        "hedges",
        "number",
        "policy",
        "previous_delay",
        "rng",
        "route",
        "used",
    )

    def __init__(
        self,
        route: Route,
        attempter: Attempter,
        deadline: Deadline,
        constraints: Constraints,
        clock: Clock,
        rng: Rng,
        events: EventSink,
        gate: RetryGate,
    ) -> None:
        self.route = route
        self.policy = route.retry
        self.attempter = attempter
        self.deadline = deadline
        self.c = constraints
        self.clock = clock
        self.rng = rng
        self.events = events
        self.gate = gate
        self.number = 0
        self.hedges = 0
        self.previous_delay: float | None = None
        self.used: list[Endpoint] = []

    def timeout(self) -> float:
        left = self.deadline.remaining(self.clock.monotonic())
        p = self.policy.per_try_timeout
        return left if p is None else min(p, left)

    def judge(self, a: Attempted) -> Decision:
        """After the last running attempt failed (or any attempt answered): return, or
        retry after a delay."""
        outcome = a.outcome
        if outcome.refused_below is not None:
            return Stop(outcome.refused_below)
        c = self.c
        if not c.killed and self.gate.killed():
            c = Constraints(c.may_resend, c.body_replayable, c.edge_owned, True)
        decision = decide(
            self.policy,
            outcome,
            self.number,
            self.previous_delay,
            self.deadline,
            a.ended,
            self.clock.wall(),
            self.rng,
            c,
        )
        if isinstance(decision, Retry):
            if self.gate.draining():
                # Shutting down: no more backoff sleeps; the last result stands.
                return Stop(Fate.DRAINING)
            refused = self.gate.allow_retry()
            if refused is not None:
                return Stop(refused)
            return decision
        fate = decision.fate
        if isinstance(a.error, AttemptTimeout) and self.deadline.expired(self.clock.monotonic()):
            fate = Fate.DEADLINE
        return Stop(fate)

    async def backoff(self, a: Attempted, retry: Retry) -> bool:
        """Sleep before the next attempt; False when the deadline went meanwhile."""
        a.discard()
        self.events.retry_scheduled(
            RetryScheduled(self.route.name, self.number + 1, retry.delay, retry.from_retry_after)
        )
        self.previous_delay = retry.delay
        await self.gate.sleep(retry.delay)
        return self.deadline.remaining(self.clock.monotonic()) > 0

    def spent(self) -> SequenceResult:
        # No byte is written upstream once the deadline is spent (a long bulkhead wait, or
        # a backoff that decide() allowed ending exactly at the deadline).
        return SequenceResult(
            Fate.DEADLINE,
            self.number,
            None,
            NoTimeLeft("the sequence deadline is spent"),
            self.hedges,
        )

    async def one_at_a_time(self) -> SequenceResult:
        while True:
            if self.deadline.remaining(self.clock.monotonic()) <= 0:
                return self.spent()
            self.number += 1
            endpoint = self.attempter.pick(self.used)
            self.used.append(endpoint)
            a = await self.attempter.attempt(self.number, False, endpoint, self.timeout())
            if isinstance(a.error, LocalOverload):
                # No room in the sidecar (concurrency limit, pool): the upstream was not
                # asked, so this is not retried here and not counted as its failure.
                return _result(Fate.OVERLOADED, self.number, a, self.hedges)
            d = self.judge(a)
            if isinstance(d, Stop):
                return _result(d.fate, self.number, a, self.hedges)
            if not await self.backoff(a, d):
                return self.spent()

    async def hedged(self, after: float) -> SequenceResult:
        last: Attempted | None = None  # a failure kept as the answer if nothing better comes
        async with AttemptSet() as running:
            self._start(running, hedge=False)
            started = self.clock.monotonic()
            hedge_at = started + after
            refused = False  # a hedge of the newest attempt was refused (reported once)
            while True:
                wait: float | None = None
                if self.number < self.policy.attempts:
                    wait = max(0.0, hedge_at - self.clock.monotonic())
                a = await running.next(wait)
                if a is None:
                    now = self.clock.monotonic()
                    if self._maybe_hedge(running, report=not refused):
                        hedge_at = now + after
                        refused = False
                    else:
                        # Refused: ask again later, backing off (the wait so far doubles),
                        # not every ``after`` for as long as the attempt runs.
                        hedge_at = now + max(after, now - started)
                        refused = True
                    continue
                if isinstance(a.error, LocalOverload):
                    if running.active:
                        continue  # a hedge found no room after all; the others go on
                    if last is not None:
                        last.discard()
                    return _result(Fate.OVERLOADED, self.number, a, self.hedges)
                if self._failed(a) and running.active and not self.deadline.expired(a.ended):
                    if last is not None:
                        last.discard()
                    last = a  # the others are this sequence's retries: wait for them
                    continue
                if last is not None and last is not a:
                    last.discard()
                    last = None
                d = self.judge(a)
                if isinstance(d, Stop):
                    if a.hedge and d.fate is Fate.SUCCESS:
                        self.events.hedged(HedgeEvent(self.route.name, "won"))
                    return _result(d.fate, self.number, a, self.hedges)
                if not await self.backoff(a, d):
                    return self.spent()
                self._start(running, hedge=False)
                started = self.clock.monotonic()
                hedge_at = started + after
                refused = False

    def _failed(self, a: Attempted) -> bool:
        return (
            a.response is None
            or a.outcome.refused_below is not None
            or is_retryable(self.policy, a.outcome)
        )

    def _start(self, running: AttemptSet, hedge: bool) -> None:
        self.number += 1
        number = self.number
        # Prefer endpoints this sequence has not used: the failed one, the one being hedged.
        endpoint = self.attempter.pick(self.used)
        self.used.append(endpoint)
        timeout = self.timeout()
        attempter = self.attempter

        def run() -> Awaitable[Attempted]:
            return attempter.attempt(number, hedge, endpoint, timeout)

        running.start(run, f"attempt-{self.route.name}-{number}")

    def _maybe_hedge(self, running: AttemptSet, report: bool) -> bool:
        """Start a hedge if it may go; False when it was refused (an event the first time
        for this attempt: it is asked again later, with backoff)."""
        if self.number >= self.policy.attempts:
            return True
        if self.deadline.remaining(self.clock.monotonic()) <= 0:
            return True
        if not self.attempter.has_room():
            if report:
                self.events.hedged(HedgeEvent(self.route.name, "denied-limit"))
            return False
        refused = self.gate.allow_hedge()
        if refused is not None:
            if report:
                self.events.hedged(HedgeEvent(self.route.name, f"denied-{refused}"))
            return False
        self.hedges += 1
        self.events.hedged(HedgeEvent(self.route.name, "sent"))
        self._start(running, hedge=True)
        return True


async def run_sequence(
    route: Route,
    attempter: Attempter,
    deadline: Deadline,
    constraints: Constraints,
    clock: Clock,
    rng: Rng,
    events: EventSink,
    gate: RetryGate,
) -> SequenceResult:
    driver = _Driver(route, attempter, deadline, constraints, clock, rng, events, gate)
    after = attempter.hedge_after()
    if after is None or not math.isfinite(after) or route.retry.attempts < 2:
        return await driver.one_at_a_time()
    return await driver.hedged(after)

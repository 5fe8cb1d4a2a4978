"""The async driver of one retry sequence: attempt, classify, decide, sleep, repeat.

All judgement lives in the pure ``decide``; this module only does I/O and waiting, reading time
from an injected clock so that drain can cut a backoff sleep short.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
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
    RetryStopped,
    UpstreamError,
)
from sidecar.retry.backoff import Rng
from sidecar.retry.classify import Outcome
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints, Retry, decide
from sidecar.telemetry.events import AttemptEnded, EventSink, RetryScheduled
from sidecar.upstream.client import UpstreamResponse

# send(attempt_number, attempt_timeout) -> response; raises UpstreamError or LocalOverload.
Send = Callable[[int, float], Awaitable[UpstreamResponse]]


class RetryGate(Protocol):
    """Asked during a sequence: kill switch, budget, drain; and does the backoff sleep."""

    def killed(self) -> bool: ...

    def allow_retry(self) -> bool: ...

    def draining(self) -> bool: ...

    async def sleep(self, delay: float) -> None: ...


@dataclass(slots=True)
class SequenceResult:
    fate: Fate
    attempts: int
    response: UpstreamResponse | None = None
    error: UpstreamError | LocalOverload | None = None
    # An earlier attempt reached the upstream and failed (what the breaker judges when this
    # last attempt was refused locally and never reached it).
    failed_before: bool = False

    @property
    def response_status(self) -> int | None:
        return self.response.status if self.response is not None else None


def outcome_of(response: UpstreamResponse) -> Outcome:
    ra = response.header(b"retry-after")
    return Outcome(
        OutcomeKind.RESPONSE,
        status=response.status,
        retry_after=ra.decode("latin-1") if ra is not None else None,
    )


async def run_sequence(
    route: Route,
    send: Send,
    deadline: Deadline,
    constraints: Constraints,
    clock: Clock,
    rng: Rng,
    events: EventSink,
    gate: RetryGate,
) -> SequenceResult:
    policy = route.retry
    attempt = 0
    previous_delay: float | None = None
    while True:
        attempt += 1
        # Every retry follows a retryable outcome: an earlier attempt of this sequence failed.
        failed_before = attempt > 1
        now = clock.monotonic()
        left = deadline.remaining(now)
        if left <= 0:
            # No byte is written upstream once the deadline is spent (a long bulkhead wait, or
            # a backoff that decide() allowed ending exactly at the deadline).
            spent = NoTimeLeft("the sequence deadline is spent")
            return SequenceResult(Fate.DEADLINE, attempt - 1, None, spent, failed_before)
        per_try = min(policy.per_try_timeout, left)
        response: UpstreamResponse | None = None
        error: UpstreamError | None = None
        try:
            response = await send(attempt, per_try)
            outcome = outcome_of(response)
        except LocalOverload as refused:
            # No room in the sidecar (bulkhead or pool): the upstream was not asked, so this is
            # not retried here and not counted as the upstream's failure.
            events.attempt_ended(AttemptEnded(route.name, attempt, refused.code, 0.0, str(refused)))
            return SequenceResult(Fate.OVERLOADED, attempt, None, refused, failed_before)
        except UpstreamError as failed:
            error = failed
            outcome = Outcome(failed.kind, detail=str(failed))
        try:
            result = _judge(
                route,
                attempt,
                outcome,
                response,
                error,
                now,
                previous_delay,
                deadline,
                constraints,
                clock,
                rng,
                events,
                gate,
            )
        except BaseException:
            # Between the upstream's answer and the result, this loop owns the response.
            if response is not None:
                response.discard()
            raise
        if isinstance(result, SequenceResult):
            return result
        previous_delay = result
        await gate.sleep(result)
        if gate.killed() and not constraints.killed:
            # The kill switch was set during the backoff: the scheduled retry is not sent.
            stopped = error or RetryStopped(
                f"upstream answered {outcome.label}; the retry was stopped by the kill switch"
            )
            return SequenceResult(Fate.KILL_SWITCH, attempt, None, stopped, True)


def _judge(
    route: Route,
    attempt: int,
    outcome: Outcome,
    response: UpstreamResponse | None,
    error: UpstreamError | None,
    now: float,
    previous_delay: float | None,
    deadline: Deadline,
    constraints: Constraints,
    clock: Clock,
    rng: Rng,
    events: EventSink,
    gate: RetryGate,
) -> SequenceResult | float:
    """One attempt's outcome judged: the sequence's result, or the delay before a retry (the
    response of this attempt then discarded)."""
    policy = route.retry
    end = clock.monotonic()
    events.attempt_ended(
        AttemptEnded(route.name, attempt, outcome.label, end - now, str(error) if error else None)
    )
    c = constraints
    if gate.killed() and not c.killed:
        c = Constraints(c.may_resend, c.body_replayable, c.edge_owned, True)
    decision = decide(policy, outcome, attempt, previous_delay, deadline, end, clock.wall(), rng, c)
    if isinstance(decision, Retry) and gate.draining():
        # Shutting down: no more backoff sleeps; the last result stands.
        decision_fate: Fate | None = Fate.DRAINING
    elif isinstance(decision, Retry) and not gate.allow_retry():
        decision_fate = Fate.BUDGET_EXHAUSTED
    elif isinstance(decision, Retry):
        decision_fate = None
    else:
        decision_fate = decision.fate
    if decision_fate is not None:
        if isinstance(error, AttemptTimeout) and deadline.expired(clock.monotonic()):
            decision_fate = Fate.DEADLINE
        return SequenceResult(decision_fate, attempt, response, error, attempt > 1)
    assert isinstance(decision, Retry)
    if response is not None:
        response.discard()
    events.retry_scheduled(
        RetryScheduled(route.name, attempt + 1, decision.delay, decision.from_retry_after)
    )
    return decision.delay

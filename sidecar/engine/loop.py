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
        now = clock.monotonic()
        left = deadline.remaining(now)
        if left <= 0:
            # No byte is written upstream once the deadline is spent (a long bulkhead wait, or
            # a backoff that decide() allowed ending exactly at the deadline).
            return SequenceResult(
                Fate.DEADLINE, attempt - 1, None, NoTimeLeft("the sequence deadline is spent")
            )
        per_try = min(policy.per_try_timeout, left)
        response: UpstreamResponse | None = None
        error: UpstreamError | None = None
        try:
            response = await send(attempt, per_try)
            outcome = outcome_of(response)
        except LocalOverload as exc:
            # No room in the sidecar (bulkhead or pool): the upstream was not asked, so this is
            # not retried here and not counted as the upstream's failure.
            events.attempt_ended(AttemptEnded(route.name, attempt, exc.code, 0.0, str(exc)))
            return SequenceResult(Fate.OVERLOADED, attempt, None, exc)
        except UpstreamError as exc:
            error = exc
            outcome = Outcome(exc.kind, detail=str(exc))
        end = clock.monotonic()
        events.attempt_ended(
            AttemptEnded(
                route.name, attempt, outcome.label, end - now, str(error) if error else None
            )
        )
        c = constraints
        if gate.killed() and not c.killed:
            c = Constraints(c.may_resend, c.body_replayable, c.edge_owned, True)
        decision = decide(
            policy, outcome, attempt, previous_delay, deadline, end, clock.wall(), rng, c
        )
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
            return SequenceResult(decision_fate, attempt, response, error)
        assert isinstance(decision, Retry)
        if response is not None:
            response.discard()
        events.retry_scheduled(
            RetryScheduled(route.name, attempt + 1, decision.delay, decision.from_retry_after)
        )
        previous_delay = decision.delay
        await gate.sleep(decision.delay)

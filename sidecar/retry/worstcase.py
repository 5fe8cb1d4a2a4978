"""Worst cases of a route's policy, computed by running the pure ``decide`` step against a
simulated outage on a fake clock. ``retry-sidecar explain`` prints these; a test checks them
against the real async driver on a fake clock."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar import outcomes
from sidecar.config.model import Route
from sidecar.core import Fate
from sidecar.outcomes import OutcomeKind
from sidecar.retry.classify import Outcome, is_retryable
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints, Retry, decide
from sidecar.retry.retry_after import MAX_DELAY_SECONDS


class _Highest:
    """The RNG at its most expensive: every jittered delay at its upper end."""

    def uniform(self, a: float, b: float) -> float:
        return max(a, b)


@dataclass(frozen=True, slots=True)
class Simulated:
    attempts: int
    wall_clock: float
    fate: Fate


def failing_outcomes(route: Route) -> list[Outcome]:
    """The retryable failures this policy can see in an outage."""
    p = route.retry
    out = [Outcome(kind) for kind in outcomes.RETRY_ON_WORDS.values()]
    for status in sorted(p.retry_on.statuses):
        ra = None
        if p.retry_after.honor and status in (429, 503):
            ra = str(int(min(p.retry_after.max, MAX_DELAY_SECONDS)))
        out.append(Outcome(OutcomeKind.RESPONSE, status=status, retry_after=ra))
    return [o for o in out if is_retryable(p, o)] or [Outcome(OutcomeKind.PER_TRY_TIMEOUT)]


NO_CONSTRAINTS = Constraints()


def per_try(route: Route) -> float:
    """The longest one attempt may take: a fixed per-try timeout, else (``auto``: an attempt
    is raced, never abandoned) the route's deadline."""
    p = route.retry.per_try_timeout
    return route.timeout if p is None else min(p, route.timeout)


def simulate(
    route: Route, outcome: Outcome, attempt_seconds: float, c: Constraints = NO_CONSTRAINTS
) -> Simulated:
    """Every attempt fails with ``outcome`` after ``attempt_seconds`` (clipped by the per-try
    timeout and the deadline); sleeps are taken in full."""
    now = 0.0
    wall = 0.0
    deadline = Deadline.start(now, route.timeout)
    rng = _Highest()
    attempt = 0
    previous: float | None = None
    while True:
        attempt += 1
        took = min(attempt_seconds, per_try(route), deadline.remaining(now))
        now += took
        wall += took
        d = decide(
            route.retry,
            outcome,
            attempt,
            previous,
            deadline,
            now,
            now_wall=wall,
            rng=rng,
            constraints=c,
        )
        if not isinstance(d, Retry):
            return Simulated(attempt, now, d.fate)
        previous = d.delay
        now += d.delay
        wall += d.delay


@dataclass(frozen=True, slots=True)
class WorstCase:
    attempts: int  # most attempts one request can make (instant failures)
    wall_clock: float  # longest one request can take (slowest failures, longest waits)
    wall_clock_fate: Fate


def worst_case(route: Route) -> WorstCase:
    outcomes = failing_outcomes(route)
    fast = max((simulate(route, o, 0.0) for o in outcomes), key=lambda s: s.attempts)
    slow = max(
        (simulate(route, o, per_try(route)) for o in outcomes),
        key=lambda s: s.wall_clock,
    )
    return WorstCase(fast.attempts, slow.wall_clock, slow.fate)


def budget_multiplier(route: Route, attempts: int, request_rate: float) -> float:
    """Upstream calls per client request in a full outage with the retry budget in force."""
    b = route.budget
    extra = b.ratio + (b.min_per_second / request_rate if request_rate > 0 else float("inf"))
    return 1.0 + min(attempts - 1, extra)


def stacked(per_tier: float, tiers: int, edge_only: bool) -> float:
    """Calls reaching the bottom per client request when ``tiers`` sidecars are chained.

    Naive stacking multiplies at every tier; with edge-only marking the inner tiers make one
    attempt each (their connect-failure retries never reach the bottom service).
    """
    return per_tier if edge_only else per_tier**tiers

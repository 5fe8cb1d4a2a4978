"""The decide step: after one attempt, return, retry after a delay, or give up. Pure.

Inputs are values only: the policy, the attempt's classified outcome, the sequence state, the
deadline, ``now`` (monotonic), ``now_wall`` (epoch, for Retry-After dates) and an RNG. The async
driver (``loop.py``) does the I/O and the sleeping.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config.model import RetryPolicy
from sidecar.core import Fate
from sidecar.outcomes import OutcomeKind
from sidecar.retry import backoff
from sidecar.retry.backoff import Rng
from sidecar.retry.classify import Outcome, is_retryable, is_success, nothing_reached_upstream
from sidecar.retry.deadline import Deadline
from sidecar.retry.retry_after import parse_pushback, parse_retry_after

# Retry-After is honoured with up to this fraction of extra jitter, so that every client told
# "wait 5s" does not come back in the same millisecond.
RETRY_AFTER_JITTER = 0.1


# Not frozen: one is made per sequence, and under the compiled build a dataclass __init__ stays
# interpreted, where a frozen one costs 3-5x a plain one (object.__setattr__ per field).
# Treated as immutable all the same.
@dataclass(slots=True, init=False)
class Constraints:
    """Facts about the whole sequence that limit resending, fixed when it starts."""

    may_resend: bool = True  # idempotent method, or allowed by non_idempotent
    body_replayable: bool = True  # body was buffered (<= max_body_bytes)
    edge_owned: bool = False  # a trusted upstream tier already owns retries
    killed: bool = False  # a kill switch covers this route
    once: bool = False  # sent once whatever comes back (an upgrade: a protocol switch)

    # An explicit __init__: mypyc compiles it, where the one @dataclass generates stays
    # interpreted (~3,000 instructions per object made, against ~300). One is made per sequence.
    def __init__(
        self,
        may_resend: bool = True,
        body_replayable: bool = True,
        edge_owned: bool = False,
        killed: bool = False,
        once: bool = False,
    ) -> None:
        self.may_resend = may_resend
        self.body_replayable = body_replayable
        self.edge_owned = edge_owned
        self.killed = killed
        self.once = once


@dataclass(frozen=True, slots=True)
class Retry:
    delay: float
    from_retry_after: bool = False


@dataclass(frozen=True, slots=True)
class Stop:
    fate: Fate


Decision = Retry | Stop
# One Stop per fate, shared: decide() runs after every attempt.
_STOP = {f: Stop(f) for f in Fate}


UNCONSTRAINED = Constraints()  # never modified: shared as the default


def stop(fate: Fate) -> Stop:
    """The shared ``Stop`` for ``fate``."""
    return _STOP[fate]


def decide(
    policy: RetryPolicy,
    outcome: Outcome,
    attempt: int,
    previous_delay: float | None,
    deadline: Deadline,
    now: float,
    *,
    now_wall: float,
    rng: Rng,
    constraints: Constraints = UNCONSTRAINED,
) -> Decision:
    """``attempt`` is the number of attempts made so far (1 after the first)."""
    retryable = is_retryable(policy, outcome)
    if deadline.expired(now) and (retryable or outcome.kind is not OutcomeKind.RESPONSE):
        return _STOP[Fate.DEADLINE]
    if not retryable:
        return _STOP[Fate.SUCCESS] if is_success(outcome) else _STOP[Fate.NOT_RETRYABLE]
    if attempt >= policy.attempts:
        return _STOP[Fate.EXHAUSTED]
    untouched = nothing_reached_upstream(outcome)
    if not untouched and constraints.once:
        return _STOP[Fate.NOT_RETRYABLE]
    if not untouched and not constraints.may_resend:
        return _STOP[Fate.NON_IDEMPOTENT]
    if not untouched and not constraints.body_replayable:
        return _STOP[Fate.BODY_TOO_LARGE]
    if constraints.edge_owned and not untouched:
        return _STOP[Fate.EDGE_OWNED]
    if constraints.killed:
        return _STOP[Fate.KILL_SWITCH]

    remaining = deadline.remaining(now)
    if outcome.pushback is not None and outcome.grpc > 0:
        # gRFC A6: the server's pushback is obeyed as Retry-After is; a negative or malformed
        # one means "do not retry", whatever the policy says.
        pushed = parse_pushback(outcome.pushback)
        if pushed is None:
            return _STOP[Fate.NOT_RETRYABLE]
        if policy.retry_after.honor:
            d = min(pushed, policy.retry_after.max)
            d += rng.uniform(0.0, d * RETRY_AFTER_JITTER)
            if d >= remaining:
                return _STOP[Fate.RETRY_AFTER_TOO_LONG]
            return Retry(d, from_retry_after=True)
    if (
        policy.retry_after.honor
        and outcome.kind is OutcomeKind.RESPONSE
        and outcome.status in (429, 503)
    ):
        wanted = parse_retry_after(outcome.retry_after, now_wall)
        if wanted is not None:
            d = min(wanted, policy.retry_after.max)
            d += rng.uniform(0.0, d * RETRY_AFTER_JITTER)
            if d >= remaining:
                return _STOP[Fate.RETRY_AFTER_TOO_LONG]
            return Retry(d, from_retry_after=True)

    d = backoff.delay(policy.backoff, attempt, previous_delay, rng)
    if d >= remaining:
        return _STOP[Fate.DEADLINE]
    return Retry(d)

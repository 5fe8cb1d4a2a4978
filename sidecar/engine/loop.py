"""The async driver of one retry sequence: attempt, classify, decide, sleep, hedge, repeat.

All judgement lives in pure functions (``decide``, the throttle, the budgets, the endpoint
choice, the per-try timeout estimate); this module only does I/O and waiting, reading time from
an injected clock so that drain can cut a backoff sleep short.

Two shapes of sequence:

- one attempt at a time (most): each attempt runs in the caller's task, no timer;
- hedged (an idempotent request with a buffered body, ``per_try_timeout: auto`` and hedging on):
  attempts race as tasks (``engine/hedging.py``); this driver decides for them: when to hedge,
  where to, whether a failure is retried.

The sequence (``engine/sequence.py``) chooses the shape: hedging.py imports this module, so this
one does not import it back.
"""

from __future__ import annotations

from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from sidecar.config.model import Route
from sidecar.core import (
    AttemptTimeout,
    Clock,
    Fate,
    LocalOverload,
    NoTimeLeft,
    RetryStopped,
    UpstreamError,
)
from sidecar.engine.attempted import Attempted
from sidecar.engine.attempts import AttemptSet
from sidecar.engine.reservation import Reservation
from sidecar.outcomes import Effect
from sidecar.retry.backoff import Rng
from sidecar.retry.classify import Outcome, is_retryable
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints, Decision, Retry, Stop, decide, stop
from sidecar.retry.endpoints import Endpoint
from sidecar.telemetry.events import EventSink, HedgeEvent, RetrySent
from sidecar.upstream.client import Replay, UpstreamResponse

# A failed answer whose body has all arrived and is at most this long is kept through the
# backoff without its connection (``UpstreamResponse.detach``), so that a retry the sidecar's
# own limits then refuse relays it; a longer or unfinished one is let go before the sleep.
KEEP_ANSWER_MAX = 64 * 1024


class RetryGate(Protocol):
    """Asked during a sequence: kill switch, budget and throttle, drain; does the sleeping."""

    def killed(self) -> bool: ...

    def allow_retry(self) -> Fate | None:
        """None when a retry may go (it takes a budget token); else the fate that stops the
        sequence."""
        ...

    def retry_unsent(self) -> None:
        """The retry allowed last was not sent after all: its budget token goes back."""
        ...

    def retry_sent(self) -> None:
        """The retry allowed last went out."""
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

    def reserve(self) -> Reservation | None:
        """A concurrency ticket for a hedge, taken now; None when there is no room."""
        ...

    def pick(self, avoid: Sequence[Endpoint]) -> Endpoint: ...

    def attempt(
        self,
        number: int,
        hedge: bool,
        endpoint: Endpoint,
        timeout: float,
        reserved: Reservation | None = None,
    ) -> Coroutine[Any, Any, Attempted]: ...


@dataclass(slots=True, init=False)
class SequenceResult:
    fate: Fate
    attempts: int
    response: UpstreamResponse | None = None
    error: UpstreamError | LocalOverload | None = None
    hedges: int = 0
    outcome: Outcome | None = None  # of the attempt whose answer stands
    # An earlier attempt reached the upstream and failed (what the breaker judges when this
    # last attempt was refused locally and never reached it).
    failed_before: bool = False
    # Some attempt came back from the upstream having sent bytes of the request (an answer,
    # or an error after sending): what the DLQ records as ``reached_upstream``. Attempts that
    # failed to connect, or were refused in the sidecar, never did.
    reached: bool = False

    # An explicit __init__: mypyc compiles it, where the one @dataclass generates stays
    # interpreted (~3,000 instructions per object made, against ~300). One is made per sequence.
    def __init__(
        self,
        fate: Fate,
        attempts: int,
        response: UpstreamResponse | None = None,
        error: UpstreamError | LocalOverload | None = None,
        hedges: int = 0,
        outcome: Outcome | None = None,
        *,
        failed_before: bool = False,
        reached: bool = False,
    ) -> None:
        self.fate = fate
        self.attempts = attempts
        self.reached = reached
        self.response = response
        self.error = error
        self.hedges = hedges
        self.outcome = outcome
        self.failed_before = failed_before

    @property
    def response_status(self) -> int | None:
        return self.response.status if self.response is not None else None

    @property
    def response_grpc(self) -> int:
        """The gRPC status of an answer not committed (-1: none, or not a gRPC call)."""
        return self.response.grpc_status if self.response is not None else -1


def _result(
    fate: Fate, number: int, a: Attempted | None, hedges: int, failed_before: bool, *, reached: bool
) -> SequenceResult:
    if a is None:
        return SequenceResult(
            fate, number, None, None, hedges, None, failed_before=failed_before, reached=reached
        )
    return SequenceResult(
        fate,
        number,
        a.response,
        a.error,
        hedges,
        a.outcome,
        failed_before=failed_before,
        reached=reached,
    )


class Driver:
    """The state of one sequence's decisions (kept out of the coroutine's locals so the two
    shapes share it)."""

    __slots__ = (
        "attempter",
        "c",
        "clock",
        "deadline",
        "events",
        "failed_before",
        "gate",
        "hedges",
        "issued",
        "kept",
        "number",
        "pending",
        "policy",
        "previous_delay",
        "reached",
        "replay",
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
        *,
        events: EventSink,
        gate: RetryGate,
        replay: Replay | None = None,
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
        # A request stream kept while it fits (a gRPC call's): resendable until it outgrew
        # the buffer (gRFC A6's commit on the request side).
        self.replay = replay
        self.number = 0  # attempts that left (or are on their way): what counts
        self.issued = 0  # attempt numbers handed out (a hedge's: see ``uncount``)
        self.hedges = 0
        self.previous_delay: float | None = None
        self.used: list[Endpoint] = []
        self.failed_before = False  # an attempt that reached the upstream has failed
        self.reached = False  # an attempt came back having sent bytes (SequenceResult.reached)
        # The last failed attempt, kept through the backoff with nothing held (its answer
        # detached from its connection, or an error): what stands if the retry is refused
        # locally, as when the budget or the throttle refuses it.
        self.kept: Attempted | None = None
        # The retry decided (its budget token taken) whose attempt has not come back yet.
        self.pending: RetrySent | None = None

    def result(self, fate: Fate, a: Attempted | None) -> SequenceResult:
        return _result(fate, self.number, a, self.hedges, self.failed_before, reached=self.reached)

    def judged(self, a: Attempted) -> Decision:
        """``judge``, owning ``a``'s response until it returns: an exception on the way
        (a bug, a cancellation) lets it go instead of leaking its connection."""
        try:
            return self.judge(a)
        except BaseException:
            a.discard()
            raise

    def note_failure(self, a: Attempted) -> None:
        """Remember that an attempt reached the upstream and failed (for the verdict of a
        sequence whose last attempt is then refused locally)."""
        if a.error is not None and not isinstance(a.error, LocalOverload):
            if a.error.answer.breaker is Effect.FAILURE:
                self.failed_before = True
        elif a.response is not None and is_retryable(self.policy, a.outcome):
            self.failed_before = True

    def timeout(self) -> float:
        left = self.deadline.remaining(self.clock.monotonic())
        p = self.policy.per_try_timeout
        return left if p is None else min(p, left)

    def judge(self, a: Attempted) -> Decision:
        """After the last running attempt failed (or any attempt answered): return, or
        retry after a delay."""
        outcome = a.outcome
        if outcome.refused_below is not None:
            return stop(outcome.refused_below)
        c = self.c
        if not c.killed and self.gate.killed():
            c = Constraints(c.may_resend, c.body_replayable, c.edge_owned, True, c.once)
        replay = self.replay
        if replay is not None and not replay.replayable:
            c = Constraints(c.may_resend, False, c.edge_owned, c.killed, c.once)
        decision = decide(
            self.policy,
            outcome,
            self.number,
            self.previous_delay,
            self.deadline,
            a.ended,
            now_wall=self.clock.wall(),
            rng=self.rng,
            constraints=c,
        )
        if isinstance(decision, Retry):
            if self.gate.draining():
                # Shutting down: no more backoff sleeps; the last result stands.
                return stop(Fate.DRAINING)
            refused = self.gate.allow_retry()
            if refused is not None:
                return stop(refused)
            return decision
        fate = decision.fate
        if isinstance(a.error, AttemptTimeout) and self.deadline.expired(self.clock.monotonic()):
            fate = Fate.DEADLINE
        return stop(fate)

    async def backoff(self, a: Attempted, retry: Retry) -> SequenceResult | None:
        """Sleep before the next attempt; a result when the sequence ends instead (the
        deadline went meanwhile, or the kill switch was set during the wait)."""
        self.keep(a)
        self.pending = RetrySent(
            self.route.name, self.number + 1, retry.delay, retry.from_retry_after
        )
        self.previous_delay = retry.delay
        try:
            await self.gate.sleep(retry.delay)
        except BaseException:
            self.unsent()  # the client left during the backoff: the retry is not sent
            raise
        if not self.c.killed and self.gate.killed():
            # The kill switch was set during the backoff: the scheduled retry is not sent.
            self.unsent()
            stopped = a.error or RetryStopped(
                f"upstream answered {a.outcome.label}; the retry was stopped by the kill switch",
                a.outcome.status or None,
            )
            return SequenceResult(
                Fate.KILL_SWITCH,
                self.number,
                None,
                stopped,
                self.hedges,
                a.outcome,
                failed_before=True,
                reached=self.reached,
            )
        if self.deadline.remaining(self.clock.monotonic()) <= 0:
            self.unsent()
            return self.spent()
        return None

    def keep(self, a: Attempted) -> None:
        """Keep ``a`` through the backoff, holding nothing: its answer detached from its
        connection when it is complete and small, else let go now."""
        self.kept = a
        up = a.response
        if up is not None and not up.detach_answer(KEEP_ANSWER_MAX):
            up.discard()
            self.kept = None

    def unsent(self) -> None:
        """The pending retry was not sent: not counted, its budget token given back."""
        if self.pending is not None:
            self.pending = None
            self.gate.retry_unsent()
        self.kept = None

    def came_back(self, a: Attempted) -> None:
        """Attempt ``a`` came back from the upstream (not refused locally): when it is the
        pending retry, that retry was sent."""
        err = a.error
        if err is None or err.reached_upstream:
            self.reached = True
        p = self.pending
        if p is not None and p.attempt == a.number and not a.hedge:
            self.pending = None
            self.gate.retry_sent()
            self.events.retry_sent(p)
            self.kept = None

    def refused(self, a: Attempted) -> SequenceResult:
        """No room in the sidecar for attempt ``a`` (concurrency limit, pool): the upstream was
        not asked, so it is not retried here and not counted as its failure. A refused retry
        is not sent (its budget token goes back) and the last upstream answer stands, with fate
        ``overloaded``, as when the budget or the throttle refuses a retry; without one (a
        first attempt, or an answer too long to keep) the sidecar answers itself."""
        kept = self.kept
        self.not_sent(a)
        if kept is not None:
            return self.result(Fate.OVERLOADED, kept)
        return self.result(Fate.OVERLOADED, a)

    def not_sent(self, a: Attempted) -> None:
        """Attempt ``a`` was refused locally: when it is the pending retry, it was not sent."""
        p = self.pending
        if p is not None and p.attempt == a.number and not a.hedge:
            self.unsent()

    def ended(self) -> None:
        """The sequence is over. A retry still pending was interrupted while its attempt ran
        (the client left, a hedge won): it may have gone out, so it counts as sent."""
        p = self.pending
        if p is not None:
            self.pending = None
            self.gate.retry_sent()
            self.events.retry_sent(p)
        self.kept = None

    def spent(self) -> SequenceResult:
        # No byte is written upstream once the deadline is spent (a long bulkhead wait, or
        # a backoff that decide() allowed ending exactly at the deadline).
        spent = NoTimeLeft("the sequence deadline is spent")
        return SequenceResult(
            Fate.DEADLINE,
            self.number,
            None,
            spent,
            self.hedges,
            None,
            failed_before=self.failed_before,
            reached=self.reached,
        )

    async def one_at_a_time(self) -> SequenceResult:
        try:
            while True:
                if self.deadline.remaining(self.clock.monotonic()) <= 0:
                    return self.spent()
                self.number += 1
                endpoint = self.attempter.pick(self.used)
                self.used.append(endpoint)
                a = await self.attempter.attempt(self.number, False, endpoint, self.timeout())
                if isinstance(a.error, LocalOverload):
                    return self.refused(a)
                self.came_back(a)
                d = self.judged(a)
                if isinstance(d, Stop):
                    return self.result(d.fate, a)
                self.note_failure(a)
                ended = await self.backoff(a, d)
                if ended is not None:
                    return ended
        finally:
            self.ended()

    def failed(self, a: Attempted) -> bool:
        return (
            a.response is None
            or a.outcome.refused_below is not None
            or is_retryable(self.policy, a.outcome)
        )

    def start(self, running: AttemptSet, hedge: bool, reserved: Reservation | None = None) -> None:
        """Start an attempt as a task of ``running``; it owns ``reserved`` from here on (also
        when its task is cancelled before it ran: its done-callback gives the ticket back)."""
        try:
            self.number += 1
            self.issued = max(self.issued + 1, self.number)
            number = self.issued
            # Prefer endpoints this sequence has not used: the failed one, the one being hedged.
            endpoint = self.attempter.pick(self.used)
            self.used.append(endpoint)
            timeout = self.timeout()
            attempter = self.attempter

            def run() -> Coroutine[Any, Any, Attempted]:
                return attempter.attempt(number, hedge, endpoint, timeout, reserved)

            task = running.start(run, f"attempt-{self.route.name}-{number}")
        except BaseException:
            if reserved is not None:
                reserved.give_back(None)
            raise
        if reserved is not None:
            task.add_done_callback(reserved.on_done)

    def may_hedge(self) -> bool:
        """No new hedge once a kill switch covers the route or a drain has begun (the attempts
        already out may still answer; the retry path asks the same two in ``judge``)."""
        return not self.gate.killed() and not self.gate.draining()

    def maybe_hedge(self, running: AttemptSet, report: bool) -> bool:
        """Start a hedge if it may go; False when it was refused (an event the first time
        for this attempt: it is asked again later, with backoff). Nothing counts a refused
        hedge: its concurrency ticket is taken first, here, so that a hedge that is counted
        is one that leaves."""
        if self.number >= self.policy.attempts:
            return True
        if self.deadline.remaining(self.clock.monotonic()) <= 0:
            return True
        reserved = self.attempter.reserve()
        if reserved is None:
            if report:
                self.events.hedged(HedgeEvent(self.route.name, "denied-limit"))
            return False
        try:
            refused = self.gate.allow_hedge()
        except BaseException:
            reserved.give_back(None)
            raise
        if refused is not None:
            reserved.give_back(None)
            if report:
                self.events.hedged(HedgeEvent(self.route.name, f"denied-{refused}"))
            return False
        self.hedges += 1
        self.events.hedged(HedgeEvent(self.route.name, "sent"))
        self.start(running, True, reserved)
        return True

    def uncount(self, a: Attempted) -> None:
        """An attempt refused in the sidecar (the pool stayed full) while others of the
        sequence ran: it never left, so it counts neither as an attempt nor as a hedge. Its
        number stays used: the next attempt gets a new one, never the number of one out."""
        self.number -= 1
        if a.hedge:
            self.hedges -= 1

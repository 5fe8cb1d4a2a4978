"""One upstream attempt of one route, with everything it holds and feeds back.

``RouteAttempter.attempt`` takes a ticket from the route's adaptive concurrency limit (given
back in a ``finally``: return, error or cancellation), sends the request to the endpoint the
driver picked, and turns the result into an ``Attempted``. On the way it feeds the route's
state: the throttle (accepted or not), the latency estimate behind ``per_try_timeout: auto``,
the concurrency limit (latency to the response head) and the endpoint's passive health. An
attempt cancelled (a hedge that lost, the deadline, the client gone) feeds its event (outcome
``cancelled``) and, when it ran at least the adaptive per-try timeout, the latency estimate as
a censored sample (it took at least that long).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from sidecar import outcomes
from sidecar.config.model import Route
from sidecar.core import Clock, ConcurrencyLimited, LocalOverload, UpstreamError
from sidecar.engine.attempted import Attempted, outcome_of
from sidecar.engine.reservation import Reservation
from sidecar.engine.routestate import RouteState
from sidecar.outcomes import Effect, OutcomeKind
from sidecar.retry.classify import REFUSED_BELOW, Outcome, accepted
from sidecar.retry.concurrency import Ticket
from sidecar.retry.endpoints import Endpoint
from sidecar.telemetry.events import AttemptEnded, EventSink
from sidecar.upstream.client import UpstreamResponse

# send(attempt number, timeout, endpoint, hedge) -> response; raises UpstreamError or
# LocalOverload.
Send = Callable[[int, float, Endpoint, bool], Awaitable[UpstreamResponse]]
_LOCAL = Outcome(OutcomeKind.CONNECT_FAILURE, detail="refused in the sidecar")  # never judged


class RouteAttempter:
    __slots__ = (
        "_clock",
        "_events",
        "_hedgeable",
        "_hedgeable_route",
        "_limit",
        "_route",
        "_send",
        "_state",
    )

    def __init__(
        self,
        route: Route,
        state: RouteState,
        send: Send,
        clock: Clock,
        events: EventSink,
        hedgeable: bool,
        *,
        adaptive: bool,
    ) -> None:
        self._route = route
        self._state = state
        self._send = send
        self._clock = clock
        self._events = events
        self._hedgeable = hedgeable
        # Whether this route hedges at all: its attempts then tell the latency estimate when
        # they run long (any of its attempts, so that a first slow one arms hedging).
        self._hedgeable_route = route.hedge.enabled and route.retry.per_try_timeout is None
        self._limit = adaptive and route.bulkhead.adaptive

    def _auto(self, now: float) -> float:
        a = self._route.retry.auto_timeout
        return self._state.latency.timeout(now, a.percentile, a.multiplier, a.min, a.max)

    def hedge_after(self) -> float | None:
        if not self._hedgeable:
            return None
        now = self._clock.monotonic()
        if not self._state.latency.tail_seen(now):
            # No attempt of this route ran past the timeout lately: run this one inline. The
            # first slow one is then not hedged, and arms hedging for the next ones.
            return None
        return self._auto(now)

    def reserve(self) -> Reservation | None:
        """A ticket of the concurrency limit for a hedge, taken now (in the turn that decides
        it); None when there is no room."""
        lim = self._state.limiter
        if not self._limit:
            return Reservation(lim, None, self._clock)
        ticket = lim.try_acquire(self._clock.monotonic())
        return None if ticket is None else Reservation(lim, ticket, self._clock)

    def pick(self, avoid: Sequence[Endpoint]) -> Endpoint:
        return self._state.endpoints.pick(self._clock.monotonic(), avoid)

    async def attempt(
        self,
        number: int,
        hedge: bool,
        endpoint: Endpoint,
        timeout: float,
        reserved: Reservation | None = None,
    ) -> Attempted:
        """``reserved``: the ticket the driver took for it (a hedge); else it takes its own."""
        clock = self._clock
        st = self._state
        name = self._route.name
        start = clock.monotonic()
        ticket: Ticket | None = None
        if reserved is None and self._limit:
            ticket = st.limiter.try_acquire(start)
            if ticket is None:
                err = ConcurrencyLimited(
                    f"the adaptive concurrency limit of route {name} "
                    f"({int(st.limiter.limit)}) is reached"
                )
                self._events.attempt_ended(AttemptEnded(name, number, err.code, 0.0, str(err)))
                return Attempted(
                    number, endpoint, hedge, start, start, _LOCAL, response=None, error=err
                )
        latency: float | None = None
        finished = False
        try:
            try:
                response = await self._send(number, timeout, endpoint, hedge)
            except UpstreamError as exc:
                end = clock.monotonic()
                outcome = Outcome(exc.kind, detail=str(exc), grpc=exc.grpc)
                if exc.answer.limit is Effect.FAILURE:
                    latency = end - start  # at least this long: a timeout is a slow sample
                self._settle(end, endpoint, outcome, exc, None)
                finished = True
                self._events.attempt_ended(
                    AttemptEnded(name, number, outcome.label, end - start, str(exc))
                )
                return Attempted(
                    number, endpoint, hedge, start, end, outcome, response=None, error=exc
                )
            except LocalOverload as full:  # the pool stayed full ("full", not "exc": mypyc)
                end = clock.monotonic()
                finished = True
                self._events.attempt_ended(AttemptEnded(name, number, full.code, 0.0, str(full)))
                return Attempted(
                    number, endpoint, hedge, start, end, _LOCAL, response=None, error=full
                )
            end = clock.monotonic()
            refused = None
            if response.status == 503:
                code = response.proxy_error
                if code is not None:
                    refused = REFUSED_BELOW.get(code.decode("latin-1").strip())
            outcome = outcome_of(response, refused)
            latency = end - start
            if refused is None:
                st.latency.observe(end, latency)
            self._settle(end, endpoint, outcome, None, refused)
            finished = True
            self._events.attempt_ended(AttemptEnded(name, number, outcome.label, latency, None))
            return Attempted(
                number, endpoint, hedge, start, end, outcome, response=response, error=None
            )
        finally:
            now = clock.monotonic()
            if reserved is not None:
                reserved.give_back(latency)
            elif ticket is not None:
                st.limiter.release(now, ticket, latency)
            took = now - start
            if (
                self._hedgeable_route
                and took >= self._route.retry.auto_timeout.min
                and took >= self._auto(now)
            ):
                st.latency.ran_long(now)
            if not finished:
                # Cancelled: a hedge that lost, the deadline, or the client went away. It took
                # at least this long (counted if that reaches the timeout in force).
                st.latency.observe_censored(now, took, self._auto(now))
                self._events.attempt_ended(
                    AttemptEnded(
                        name, number, outcomes.CANCELLED.name, clock.monotonic() - start, None
                    )
                )

    def _settle(
        self,
        now: float,
        endpoint: Endpoint,
        outcome: Outcome,
        error: UpstreamError | None,
        refused: object,
    ) -> None:
        """Feed the throttle and the endpoint's health: an answer by the route's policy, a
        failure by its row of the outcome table."""
        st = self._state
        if error is None:
            if refused is None:
                st.throttle.record(now, accepted(self._route.retry, outcome))
            st.endpoints.report(now, endpoint, False)
            return
        row = error.answer
        if row.throttle is not Effect.NOT_COUNTED:
            st.throttle.record(now, row.throttle is Effect.SUCCESS)
        st.endpoints.report(now, endpoint, row.endpoint is Effect.FAILURE)

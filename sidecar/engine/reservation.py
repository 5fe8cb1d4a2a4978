"""A concurrency ticket taken for a hedge in the turn that decides it, before its task runs.

A hedge is decided in the driver's turn and runs in a task that starts a loop turn later. Were
its ticket taken there, another request could take the last one in between: the hedge would be
refused after it had been counted (attempt number, hedge budget, ``sent``) -- an attempt that
never left. So the driver reserves the ticket first and only then counts the hedge; the attempt
takes the reservation over and gives the ticket back when it ends.

A task cancelled before its first step (the client gone, the deadline, a winner in the same
turn) never runs its coroutine, so never reaches the attempt's ``finally``: its done-callback
(``on_done``) gives the ticket back instead. ``give_back`` acts once, whoever calls it first.
"""

from __future__ import annotations

from sidecar.core import Clock
from sidecar.retry.concurrency import AdaptiveLimit, Ticket


class Reservation:
    __slots__ = ("_clock", "_limiter", "_ticket")

    def __init__(self, limiter: AdaptiveLimit, ticket: Ticket | None, clock: Clock) -> None:
        self._limiter = limiter
        self._ticket = ticket  # None: the route has no adaptive limit (nothing to give back)
        self._clock = clock

    @property
    def held(self) -> bool:
        return self._ticket is not None

    def give_back(self, latency: float | None) -> None:
        """Release the ticket with the attempt's latency (None: it says nothing about it)."""
        ticket, self._ticket = self._ticket, None
        if ticket is not None:
            self._limiter.release(self._clock.monotonic(), ticket, latency)

    def on_done(self, _task: object) -> None:
        """The attempt's task ended; a no-op when the attempt gave the ticket back itself."""
        self.give_back(None)

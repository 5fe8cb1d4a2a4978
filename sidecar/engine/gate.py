"""The RetryGate of one sequence: kill switch, adaptive throttle, budgets and drain for one
route."""

from __future__ import annotations

import random
from typing import Protocol

from sidecar.core import Clock, Fate
from sidecar.engine.routestate import RouteState
from sidecar.lifecycle import Lifecycle


class Switches(Protocol):
    """The kill switches (``sidecar.admin.killswitch.KillSwitch``), as the engine sees them."""

    def covers(self, route: str, now: float) -> bool: ...


class SequenceGate:
    __slots__ = ("_clock", "_kill", "_life", "_rng", "_route", "_spent_at", "_state")

    def __init__(
        self,
        route: str,
        state: RouteState,
        kill: Switches,
        life: Lifecycle,
        clock: Clock,
        rng: random.Random,
    ) -> None:
        self._route = route
        self._state = state
        self._kill = kill
        self._life = life
        self._clock = clock
        self._rng = rng
        self._spent_at: float | None = None  # when the retry allowed last took its token

    def killed(self) -> bool:
        return self._kill.covers(self._route, self._clock.monotonic())

    def allow_retry(self) -> Fate | None:
        """The throttle first (a refusal there spends no budget), then the retry budget."""
        now = self._clock.monotonic()
        st = self._state
        if not st.throttle.allow(now, self._rng):
            return Fate.THROTTLED
        if not st.budget.try_retry(now):
            return Fate.BUDGET_EXHAUSTED
        self._spent_at = now
        return None

    def retry_unsent(self) -> None:
        """The retry allowed last was not sent after all: its budget token goes back."""
        at, self._spent_at = self._spent_at, None
        if at is not None:
            self._state.budget.give_back(at)

    def retry_sent(self) -> None:
        """The retry allowed last went out: its token stays spent."""
        self._spent_at = None

    def allow_hedge(self) -> str | None:
        now = self._clock.monotonic()
        st = self._state
        if not st.throttle.allow(now, self._rng):
            return "throttle"
        if not st.hedge_budget.try_retry(now):
            return "budget"
        return None

    def draining(self) -> bool:
        return self._life.draining

    async def sleep(self, delay: float) -> None:
        """The backoff: ``delay`` seconds, ended early by a drain or by a kill switch that
        covers this route (set while it waits: the retry it waits for will not be sent, so
        the client is not held for nothing). A switch set for another route wakes the sleep
        too; it then sleeps the rest of its delay."""
        end = self._clock.monotonic() + delay
        while await self._life.sleep(delay):
            if self.killed():
                return
            delay = end - self._clock.monotonic()

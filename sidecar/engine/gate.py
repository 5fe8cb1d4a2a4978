"""The RetryGate of one sequence: kill switch, budget and drain for one route."""

from __future__ import annotations

from typing import Protocol

from sidecar.core import Clock
from sidecar.engine.routestate import RouteState
from sidecar.lifecycle import Lifecycle


class Switches(Protocol):
    """The kill switches (``sidecar.admin.killswitch.KillSwitch``), as the engine sees them."""

    def covers(self, route: str, now: float) -> bool: ...


class SequenceGate:
    __slots__ = ("_clock", "_kill", "_life", "_route", "_state")

    def __init__(
        self, route: str, state: RouteState, kill: Switches, life: Lifecycle, clock: Clock
    ) -> None:
        self._route = route
        self._state = state
        self._kill = kill
        self._life = life
        self._clock = clock

    def killed(self) -> bool:
        return self._kill.covers(self._route, self._clock.monotonic())

    def allow_retry(self) -> bool:
        return self._state.budget.try_retry(self._clock.monotonic())

    def draining(self) -> bool:
        return self._life.draining

    async def sleep(self, delay: float) -> None:
        await self._life.sleep(delay)

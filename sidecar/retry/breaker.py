"""The circuit breaker of one route: a small explicit state machine, clock injected.

It counts retry SEQUENCES, not attempts: ``admit`` is called once when a sequence starts and
``record`` once when it ends, whatever the number of attempts in between.

    closed --(failure ratio >= failure_ratio over >= min_sequences in window)--> open
    open --(open_for elapsed, at the next admit)--> half-open
    half-open --(half_open_probes successes)--> closed
    half-open --(a probe fails)--> open

Any other transition is a bug and raises IllegalTransition.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

from sidecar.config.model import BreakerPolicy
from sidecar.core import Verdict
from sidecar.retry.window import Window


class State(Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half-open"


GAUGE = {State.CLOSED: 0, State.HALF_OPEN: 1, State.OPEN: 2}
_LEGAL = {
    (State.CLOSED, State.OPEN),
    (State.OPEN, State.HALF_OPEN),
    (State.HALF_OPEN, State.CLOSED),
    (State.HALF_OPEN, State.OPEN),
}


class IllegalTransition(Exception):  # not RuntimeError: mypyc compiles this module
    pass


@dataclass(frozen=True, slots=True)
class Admitted:
    probe: bool  # a half-open probe: its outcome decides the state
    period: int = 0  # which half-open period admitted the probe


@dataclass(frozen=True, slots=True)
class Rejected:
    retry_after: float  # seconds until a probe may be let through


Admission = Admitted | Rejected
# Shared answers for the common cases: admit() runs once per request.
_ADMIT = Admitted(probe=False)
OnTransition = Callable[[State, State], None]


class Breaker:
    def __init__(self, policy: BreakerPolicy, on_transition: OnTransition | None = None) -> None:
        self.policy = policy
        self.state = State.CLOSED
        self.opened_at: float | None = None  # monotonic
        self.opened_at_wall: float | None = None
        self._window = Window(policy.window)  # a = sequences, b = failures
        self._probes_admitted = 0
        self._probe_successes = 0
        self._period = 0  # counts half-open periods: a probe only has a say in its own
        self._on_transition = on_transition

    def update_policy(self, policy: BreakerPolicy) -> None:
        """A reload: keep the state; a new window length starts a new window."""
        if policy.window != self.policy.window:
            self._window = Window(policy.window)
        self.policy = policy

    def _go(self, to: State, now: float, wall: float | None = None) -> None:
        frm = self.state
        if (frm, to) not in _LEGAL:
            raise IllegalTransition(f"{frm.value} -> {to.value}")
        self.state = to
        if to is State.OPEN:
            self.opened_at = now
            self.opened_at_wall = wall
        elif to is State.HALF_OPEN:
            self._period += 1
            self._probes_admitted = 0
            self._probe_successes = 0
        elif to is State.CLOSED:
            self.opened_at = None
            self.opened_at_wall = None
            self._window.clear()
        if self._on_transition is not None:
            self._on_transition(frm, to)

    def admit(self, now: float) -> Admission:
        if self.state is State.OPEN:
            assert self.opened_at is not None
            reopen = self.opened_at + self.policy.open_for
            if now < reopen:
                return Rejected(reopen - now)
            self._go(State.HALF_OPEN, now)
        if self.state is State.HALF_OPEN:
            if self._probes_admitted < self.policy.half_open_probes:
                self._probes_admitted += 1
                return Admitted(probe=True, period=self._period)
            # Every probe slot is taken; wait for their verdict.
            return Rejected(min(1.0, self.policy.open_for))
        return _ADMIT

    def record(
        self,
        now: float,
        verdict: Verdict,
        probe: bool,
        wall: float | None = None,
        period: int | None = None,
    ) -> None:
        """The one verdict of one finished sequence. A NEUTRAL verdict (the upstream was
        never asked, or the client left) counts nowhere; a neutral probe hands its probe
        slot back so the next sequence can probe instead. A probe admitted in an earlier
        half-open period (``period``, from its ``Admitted``) has no say in this one."""
        if probe and period is not None and period != self._period:
            return
        if verdict is Verdict.NEUTRAL:
            if probe and self.state is State.HALF_OPEN and self._probes_admitted > 0:
                self._probes_admitted -= 1
            return
        success = verdict is Verdict.SUCCESS
        if self.state is State.HALF_OPEN:
            if not probe:
                return  # a sequence admitted before the breaker opened: no say any more
            if not success:
                self._go(State.OPEN, now, wall)
                return
            self._probe_successes += 1
            if self._probe_successes >= self.policy.half_open_probes:
                self._go(State.CLOSED, now)
            return
        if self.state is State.OPEN:
            return  # in flight when it opened
        self._window.add(now, a=1, b=0 if success else 1)
        sequences, failures = self._window.totals(now)
        if sequences >= self.policy.min_sequences and failures >= (
            self.policy.failure_ratio * sequences
        ):
            self._go(State.OPEN, now, wall)

    def counts(self, now: float) -> tuple[int, int]:
        """(sequences, failures) in the current window."""
        return self._window.totals(now)

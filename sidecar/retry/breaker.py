"""The circuit breaker of one route: a small explicit state machine for "down", clock injected.

It counts retry SEQUENCES, not attempts: ``admit`` is called once when a sequence starts and
``record`` once when it ends, whatever the number of attempts in between. What a sequence tells
it is decided by ``classify.verdict``: only a sequence that ran its policy to the end and still
failed is evidence that the upstream is down; one cut short locally (budget, throttle, kill
switch, drain, the client leaving) or refused by a sidecar further down is neutral.

    closed --(failure ratio >= failure_ratio over >= min_sequences in window)--> open
    open --(the open period elapsed, at the next admit)--> half-open
    half-open --(ramp elapsed, >= half_open_probes judged, ratio below failure_ratio)--> closed
    half-open --(failures reach failure_ratio of max(judged, half_open_probes))--> open

The open period starts at ``open_for`` and doubles on each reopen without a close in between,
up to ``max_open_for`` (Linkerd's failure accrual backs off from 1 s the same way): a short
outage costs about a second, a long one is probed ever more rarely. Half-open does not let a
few probes decide alone: it admits a share of the traffic that grows linearly from nothing to
all of it over ``ramp`` (error diffusion, so the share is exact and needs no RNG), judges the
sequences it admitted, and closes once the ramp is over with at least ``half_open_probes`` of
them judged. A refused sequence is told how long until it would be admitted.

Any other transition is a bug and raises IllegalBreakerTransition.
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
MAX_DOUBLINGS = 32


class IllegalBreakerTransition(Exception):  # not RuntimeError: mypyc compiles this module
    pass


@dataclass(frozen=True, slots=True)
class Admitted:
    probe: bool  # admitted by the half-open ramp: its verdict is judged by the ramp
    period: int = 0  # which half-open period admitted the probe (only that one hears it)


@dataclass(frozen=True, slots=True)
class Rejected:
    retry_after: float  # seconds until a sequence would be admitted


Admission = Admitted | Rejected
# The shared answer for the common case: admit() runs once per request.
_ADMIT = Admitted(probe=False)
OnTransition = Callable[[State, State], None]


class Breaker:
    def __init__(self, policy: BreakerPolicy, on_transition: OnTransition | None = None) -> None:
        self.policy = policy
        self.state = State.CLOSED
        self.opened_at: float | None = None  # monotonic
        self.opened_at_wall: float | None = None
        self.open_period = policy.open_for  # of the current (or next) open state
        self._reopens = 0  # opens since the last close
        self._window = Window(policy.window)  # a = sequences, b = failures
        self._half_open_at = 0.0
        self._credit = 0.0
        self._judged = 0
        self._failed = 0
        self._period = 0  # counts half-open periods: a probe only has a say in its own
        self._on_transition = on_transition

    def update_policy(self, policy: BreakerPolicy) -> None:
        """A reload: keep the state; a new window length starts a new window."""
        if policy.window != self.policy.window:
            self._window = Window(policy.window)
        self.policy = policy
        if self.state is State.CLOSED:
            self.open_period = policy.open_for
        if not policy.enabled and self.state is not State.CLOSED:
            # Switched off: traffic flows at once. Through half-open, the legal way.
            if self.state is State.OPEN:
                self._go(State.HALF_OPEN, self._half_open_at)
            self._go(State.CLOSED, self._half_open_at)

    def _next_open_period(self) -> float:
        p = self.policy
        return min(p.max_open_for, p.open_for * 2.0 ** min(self._reopens, MAX_DOUBLINGS))

    def _go(self, to: State, now: float, wall: float | None = None) -> None:
        frm = self.state
        if (frm, to) not in _LEGAL:
            raise IllegalBreakerTransition(f"{frm.value} -> {to.value}")
        self.state = to
        if to is State.OPEN:
            self.opened_at = now
            self.opened_at_wall = wall
            self.open_period = self._next_open_period()
            self._reopens += 1
        elif to is State.HALF_OPEN:
            self._period += 1
            self._half_open_at = now
            self._credit = 1.0  # the first sequence after the open period is admitted
            self._judged = 0
            self._failed = 0
        elif to is State.CLOSED:
            self.opened_at = None
            self.opened_at_wall = None
            self._reopens = 0
            self.open_period = self.policy.open_for
            self._window.clear()
        if self._on_transition is not None:
            self._on_transition(frm, to)

    def share(self, now: float) -> float:
        """The share of sequences admitted now: 1 closed, 0 open, the ramp in half-open."""
        if self.state is State.CLOSED:
            return 1.0
        if self.state is State.OPEN:
            return 0.0
        ramp = self.policy.ramp
        if ramp <= 0:
            return 1.0
        return min(1.0, max(0.0, (now - self._half_open_at) / ramp))

    def admit(self, now: float) -> Admission:
        if not self.policy.enabled or self.state is State.CLOSED:
            return _ADMIT
        if self.state is State.OPEN:
            assert self.opened_at is not None
            reopen = self.opened_at + self.open_period
            if now < reopen:
                return Rejected(reopen - now)
            self._go(State.HALF_OPEN, now)
        self._credit += self.share(now)
        if self._credit >= 1.0:
            self._credit -= 1.0
            return Admitted(probe=True, period=self._period)
        # Not this one: the ramp admits the next share of traffic.
        return Rejected(max(0.0, self._half_open_at + self.policy.ramp - now))

    def record(
        self,
        now: float,
        verdict: Verdict,
        probe: bool,
        wall: float | None = None,
        period: int | None = None,
    ) -> None:
        """The one verdict of one finished sequence. A NEUTRAL verdict counts nowhere; a probe
        admitted in an earlier half-open period (``period``, from its ``Admitted``) has no say
        in this one."""
        if verdict is Verdict.NEUTRAL or not self.policy.enabled:
            return
        if probe and period is not None and period != self._period:
            return
        failed = verdict is Verdict.FAILURE
        if self.state is State.HALF_OPEN:
            if not probe:
                return  # admitted before the breaker opened: no say any more
            self._judged += 1
            self._failed += 1 if failed else 0
            p = self.policy
            if self._failed and self._failed >= p.failure_ratio * max(
                self._judged, p.half_open_probes
            ):
                self._go(State.OPEN, now, wall)
            elif now - self._half_open_at >= p.ramp and self._judged >= p.half_open_probes:
                self._go(State.CLOSED, now)
            return
        if self.state is State.OPEN:
            return  # in flight when it opened
        self._window.add(now, a=1, b=1 if failed else 0)
        sequences, failures = self._window.totals(now)
        if sequences >= self.policy.min_sequences and failures >= (
            self.policy.failure_ratio * sequences
        ):
            self._go(State.OPEN, now, wall)

    def counts(self, now: float) -> tuple[int, int]:
        """(sequences, failures) in the current window, or judged by the ramp in half-open."""
        if self.state is State.HALF_OPEN:
            return self._judged, self._failed
        return self._window.totals(now)

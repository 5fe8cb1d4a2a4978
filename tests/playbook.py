"""The retry driver without sockets, playbook style (as mitmproxy's ``Playbook``): a script of
"the driver does X" steps, each with what we answer, checked in order as the driver runs.

The driver is the real one (``engine/loop.Driver`` in the shape ``engine/sequence.shaped``
chooses), on a fake clock with a fixed random source. What it asks between attempts goes to
the real ``SequenceGate`` of a real ``RouteState`` (budget, throttle, kill switch, drain); only
the backoff sleep is the playbook's: it advances the fake clock. Attempts are answered from the
script: a response, a failure, or no head within the attempt's timeout.

A step the driver takes that is not the next one in the script fails at once, naming both; so
does a script step the driver never takes.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from sidecar.config.model import Route
from sidecar.core import AttemptTimeout, Fate, UpstreamError
from sidecar.engine.attempted import Attempted, outcome_of
from sidecar.engine.gate import SequenceGate
from sidecar.engine.loop import Driver
from sidecar.engine.routestate import RouteState
from sidecar.engine.sequence import shaped
from sidecar.lifecycle import Lifecycle
from sidecar.retry.classify import Outcome, may_resend
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints
from sidecar.retry.endpoints import Endpoint
from sidecar.telemetry.events import Recorder
from sidecar.testing import FakeClock, FixedRng
from tests.engine.test_explain import fake_response

# -- what we answer an attempt with ----------------------------------------------------------


@dataclass(frozen=True)
class Reply:
    status: int
    retry_after: str | None = None


@dataclass(frozen=True)
class Fail:
    error: UpstreamError


@dataclass(frozen=True)
class Hang:
    """No response head: the attempt's whole timeout passes, then it times out."""


Answer = Reply | Fail | Hang

# -- what the driver does --------------------------------------------------------------------


@dataclass(frozen=True)
class Attempt:
    """The driver sends attempt ``number`` with ``timeout`` seconds for its head; ``answer``
    is what comes back (not part of the comparison)."""

    number: int
    timeout: float
    answer: Answer = field(default=Reply(200), compare=False)


@dataclass(frozen=True)
class AskRetry:
    """The driver asks the gate for a retry; ``refused`` is the real gate's answer."""

    refused: Fate | None = None


@dataclass(frozen=True)
class Sleep:
    """The backoff (or a Retry-After wait) before the next attempt."""

    delay: float


@dataclass(frozen=True)
class Done:
    """The sequence's result: its fate, the attempts that counted, the status that stands."""

    fate: Fate
    attempts: int
    status: int | None = None


Step = Attempt | AskRetry | Sleep | Done


class Mismatch(AssertionError):
    pass


class Book:
    """The script and what the driver did so far; each step is checked as it happens."""

    def __init__(self, script: Sequence[Step]) -> None:
        self.script = list(script)
        self.done: list[Step] = []

    def took(self, step: Step) -> Step:
        """The driver did ``step``: it must be the next one in the script. Gives the script's
        own step (with its answer)."""
        i = len(self.done)
        if i >= len(self.script):
            raise Mismatch(f"step {i + 1}: the script has ended, the driver did {step}")
        expected = self.script[i]
        if expected != step:
            raise Mismatch(f"step {i + 1}: expected {expected}, the driver did {step}")
        self.done.append(step)
        return expected


class PlayGate:
    """The real gate, each question and answer checked against the book; the sleep is the
    fake clock's."""

    def __init__(self, real: SequenceGate, book: Book, clock: FakeClock) -> None:
        self.real = real
        self.book = book
        self.clock = clock

    def killed(self) -> bool:
        return self.real.killed()

    def allow_retry(self) -> Fate | None:
        refused = self.real.allow_retry()
        self.book.took(AskRetry(refused))
        return refused

    def retry_unsent(self) -> None:
        self.real.retry_unsent()

    def retry_sent(self) -> None:
        self.real.retry_sent()

    def allow_hedge(self) -> str | None:
        return self.real.allow_hedge()

    def draining(self) -> bool:
        return self.real.draining()

    async def sleep(self, delay: float) -> None:
        self.book.took(Sleep(round(delay, 6)))
        self.clock.advance(delay)


class PlayAttempter:
    """Answers each attempt from the book, on the fake clock; never hedged."""

    def __init__(self, book: Book, clock: FakeClock) -> None:
        self.book = book
        self.clock = clock
        self.endpoint = Endpoint("h", 1)

    def hedge_after(self) -> float | None:
        return None

    def reserve(self) -> None:
        return None

    def pick(self, avoid: object) -> Endpoint:
        return self.endpoint

    async def attempt(
        self, number: int, hedge: bool, endpoint: Endpoint, timeout: float, reserved: object = None
    ) -> Attempted:
        step = self.book.took(Attempt(number, round(timeout, 6)))
        assert isinstance(step, Attempt)
        start = self.clock.monotonic()
        answer = step.answer
        if isinstance(answer, Reply):
            response = fake_response(answer.status, answer.retry_after)
            return Attempted(
                number, endpoint, hedge, start, start, outcome_of(response), response=response
            )
        if isinstance(answer, Hang):
            self.clock.advance(timeout)
            error: UpstreamError = AttemptTimeout("no response head (playbook)")
        else:
            error = answer.error
        end = self.clock.monotonic()
        return Attempted(number, endpoint, hedge, start, end, Outcome(error.kind), error=error)


async def play(
    route: Route,
    script: Sequence[Step],
    *,
    method: str = "GET",
    idempotency_key: bool = False,
    state: RouteState | None = None,
    clock: FakeClock | None = None,
) -> None:
    """Run one sequence of ``route`` against ``script``; fails at the first step that differs,
    or when the script has steps left at the end."""
    clock = clock or FakeClock()
    state = state or RouteState(route, None)
    book = Book(script)
    gate = SequenceGate(route.name, state, _NoSwitches(), Lifecycle(), clock, random.Random(7))
    constraints = Constraints(may_resend=may_resend(route.retry, method, idempotency_key))
    driver = Driver(
        route,
        PlayAttempter(book, clock),
        Deadline.start(clock.monotonic(), route.timeout),
        constraints,
        clock,
        FixedRng(0.5),
        events=Recorder(),
        gate=PlayGate(gate, book, clock),
    )
    result = await shaped(driver)
    book.took(Done(result.fate, result.attempts, result.response_status))
    if len(book.done) != len(book.script):
        raise Mismatch(f"the driver stopped; the script expected {book.script[len(book.done)]}")


class _NoSwitches:
    def covers(self, route: str, now: float) -> bool:
        return False

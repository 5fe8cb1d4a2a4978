"""The retry sequence as playbooks (tests/playbook.py): every attempt, gate question, backoff
sleep and the final answer, in order, on a fake clock, without sockets."""

from __future__ import annotations

import random

import pytest

from sidecar.config.parse import parse_text
from sidecar.core import ConnectFailure, Fate, UpstreamReset, Verdict
from sidecar.engine.deps import EngineDeps
from sidecar.engine.routestate import RouteStates
from sidecar.engine.sequence import Exchange, Sequence
from sidecar.lifecycle import Lifecycle
from sidecar.retry.deadline import Deadline
from sidecar.telemetry.events import Recorder
from sidecar.telemetry.tracing import Tracing
from sidecar.testing import FakeClock
from sidecar.upstream.client import UpstreamClient
from tests.playbook import (
    AskRetry,
    Attempt,
    Done,
    Fail,
    Hang,
    Mismatch,
    Reply,
    Sleep,
    Step,
    play,
)

# full_jitter, base 25 ms, max 250 ms, the random source at 0.5: half of 25 ms, 50 ms, 100 ms.
FIRST, SECOND = 0.0125, 0.025


def route_of(retry: str = "{attempts: 3}", extra: str = ""):
    return parse_text(_config_text(f"    retry: {retry}\n{extra}")).routes[0]


SUCCESS_FIRST_TRY: list[Step] = [Attempt(1, 10.0, Reply(200)), Done(Fate.SUCCESS, 1, 200)]


async def test_success_first_try():
    await play(route_of(), SUCCESS_FIRST_TRY)


async def test_503_then_success():
    await play(
        route_of(),
        [
            Attempt(1, 10.0, Reply(503)),
            AskRetry(),
            Sleep(FIRST),
            Attempt(2, 10.0 - FIRST, Reply(200)),
            Done(Fate.SUCCESS, 2, 200),
        ],
    )


async def test_exhausted_relays_the_last_answer():
    await play(
        route_of(),
        [
            Attempt(1, 10.0, Reply(503)),
            AskRetry(),
            Sleep(FIRST),
            Attempt(2, 10.0 - FIRST, Reply(502)),
            AskRetry(),
            Sleep(SECOND),
            Attempt(3, 10.0 - FIRST - SECOND, Reply(503)),
            Done(Fate.EXHAUSTED, 3, 503),
        ],
    )


async def test_a_post_that_never_connected_is_retried():
    """Nothing reached the upstream: resending cannot apply the write twice."""
    await play(
        route_of(),
        [
            Attempt(1, 10.0, Fail(ConnectFailure("refused"))),
            AskRetry(),
            Sleep(FIRST),
            Attempt(2, 10.0 - FIRST, Reply(201)),
            Done(Fate.SUCCESS, 2, 201),
        ],
        method="POST",
    )


async def test_a_post_reset_without_an_idempotency_key_is_not_retried():
    """The bytes may have reached the upstream: without a key it is sent once."""
    await play(
        route_of(),
        [Attempt(1, 10.0, Fail(UpstreamReset("reset"))), Done(Fate.NON_IDEMPOTENT, 1)],
        method="POST",
    )


async def test_a_post_reset_with_an_idempotency_key_is_retried():
    await play(
        route_of(),
        [
            Attempt(1, 10.0, Fail(UpstreamReset("reset"))),
            AskRetry(),
            Sleep(FIRST),
            Attempt(2, 10.0 - FIRST, Reply(201)),
            Done(Fate.SUCCESS, 2, 201),
        ],
        method="POST",
        idempotency_key=True,
    )


async def test_retry_after_is_honoured_with_its_jitter():
    """Retry-After: 2 waits 2 s plus up to 10% (the random source at 0.5: 5%)."""
    await play(
        route_of(),
        [
            Attempt(1, 10.0, Reply(503, retry_after="2")),
            AskRetry(),
            Sleep(2.1),
            Attempt(2, 7.9, Reply(200)),
            Done(Fate.SUCCESS, 2, 200),
        ],
    )


async def test_a_retry_after_past_the_deadline_stops_at_once():
    await play(
        route_of(),
        [Attempt(1, 10.0, Reply(503, retry_after="30")), Done(Fate.RETRY_AFTER_TOO_LONG, 1, 503)],
    )


async def test_per_try_timeout_abandons_the_attempt_and_retries():
    await play(
        route_of("{attempts: 3, per_try_timeout: 1s}"),
        [
            Attempt(1, 1.0, Hang()),
            AskRetry(),
            Sleep(FIRST),
            Attempt(2, 1.0, Reply(200)),
            Done(Fate.SUCCESS, 2, 200),
        ],
    )


async def test_the_deadline_clips_the_last_attempt_and_stops_the_sequence():
    """Per-try 4 s under a 10 s deadline: the third attempt gets what is left, and once that
    is spent no fourth is tried though attempts allow five."""
    left = 10.0 - 4.0 - FIRST - 4.0 - SECOND
    await play(
        route_of("{attempts: 5, per_try_timeout: 4s}"),
        [
            Attempt(1, 4.0, Hang()),
            AskRetry(),
            Sleep(FIRST),
            Attempt(2, 4.0, Hang()),
            AskRetry(),
            Sleep(SECOND),
            Attempt(3, round(left, 6), Hang()),
            Done(Fate.DEADLINE, 3),
        ],
    )


async def test_an_empty_budget_refuses_the_retry_and_the_failure_stands():
    route = route_of(extra="    budget: {ratio: 0, min_per_second: 0}\n")
    await play(
        route,
        [
            Attempt(1, 10.0, Reply(503)),
            AskRetry(refused=Fate.BUDGET_EXHAUSTED),
            Done(Fate.BUDGET_EXHAUSTED, 1, 503),
        ],
    )


async def test_an_open_breaker_refuses_before_any_attempt():
    """The sequence scope asks the breaker first: refused, the driver never starts (no
    attempt, no connection pool made) and the client learns when to come back."""
    breaker = "    breaker: {min_sequences: 2, failure_ratio: 0.5, open_for: 1s, ramp: 0s}\n"
    route = route_of(extra=breaker)
    clock = FakeClock()
    states = RouteStates()
    states.sync(parse_text(_config_text(breaker)))
    for _ in range(2):
        states.get("r").breaker.record(clock.monotonic(), Verdict.FAILURE, probe=False)
    client = UpstreamClient()
    deps = EngineDeps(
        client, clock, random.Random(7), Recorder(), states, _Off(), Lifecycle(), Tracing()
    )
    deadline = Deadline.start(clock.monotonic(), route.timeout)
    ex = Exchange(
        route, "GET", "/x", [], None, False,
        replayable=True, edge=None, deadline=deadline, idempotency_key=False,
    )  # fmt: skip
    async with Sequence(deps, b"sc", ex) as seq:
        assert seq.result is None and seq.refused_for > 0
    assert client.stats() == {}


async def test_a_wrong_step_fails_the_playbook():
    """Each playbook can fail: a step off by one value, a step missing, a step too many."""
    wrong_delay: list[Step] = [
        Attempt(1, 10.0, Reply(503)),
        AskRetry(),
        Sleep(SECOND),
        Attempt(2, 10.0 - SECOND, Reply(200)),
        Done(Fate.SUCCESS, 2, 200),
    ]
    with pytest.raises(Mismatch, match="step 3: expected Sleep"):
        await play(route_of(), wrong_delay)
    with pytest.raises(Mismatch, match="step 2: expected Done"):
        await play(route_of(), [Attempt(1, 10.0, Reply(503)), Done(Fate.EXHAUSTED, 1, 503)])
    with pytest.raises(Mismatch, match="stopped; the script expected"):
        await play(route_of(), [*SUCCESS_FIRST_TRY, Sleep(1.0)])
    with pytest.raises(Mismatch, match="step 2: expected Done"):
        await play(route_of(), [Attempt(1, 10.0, Reply(200)), Done(Fate.SUCCESS, 1, 201)])
    with pytest.raises(Mismatch, match="step 2: expected AskRetry"):
        await play(
            route_of(),
            [
                Attempt(1, 10.0, Reply(503)),
                AskRetry(refused=Fate.BUDGET_EXHAUSTED),
                Done(Fate.BUDGET_EXHAUSTED, 1, 503),
            ],
        )


def _config_text(extra: str = "") -> str:
    return "version: 1\nroutes:\n  - name: r\n    upstream: http://h:1\n    timeout: 10s\n" + extra


class _Off:
    def covers(self, route: str, now: float) -> bool:
        return False

"""explain's numbers come from the pure decide step; check them against the real async driver
(run_sequence) on a fake clock with every attempt failing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config.parse import parse_text
from sidecar.core import AttemptTimeout, OutcomeKind
from sidecar.engine.loop import run_sequence
from sidecar.retry.classify import Outcome
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints
from sidecar.retry.worstcase import _Highest, budget_multiplier, simulate, stacked, worst_case
from sidecar.telemetry.events import Recorder
from sidecar.testing import FakeClock
from sidecar.upstream.client import UpstreamResponse

ROOT = Path(__file__).resolve().parent.parent


def route_of(retry: str, timeout: str = "10s"):
    c = parse_text(
        f"version: 1\nroutes:\n  - name: r\n    upstream: http://h:1\n    timeout: {timeout}\n"
        f"    retry: {retry}\n"
    )
    return c.routes[0]


class FakeSleepGate:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def killed(self) -> bool:
        return False

    def allow_retry(self) -> bool:
        return True

    def draining(self) -> bool:
        return False

    async def sleep(self, delay: float) -> None:
        self.clock.advance(delay)


class FakeResponse(UpstreamResponse):
    """A response with no connection (the engine type-checks what ``send`` returns)."""

    def __init__(self, status: int, retry_after: str | None) -> None:
        self.status = status
        self._ra = retry_after

    def header(self, name: bytes) -> bytes | None:
        return self._ra.encode() if name == b"retry-after" and self._ra else None

    def discard(self) -> None:
        pass


async def drive(route, fail):
    clock = FakeClock()
    start = clock.monotonic()

    async def send(attempt: int, timeout: float):
        return await fail(clock, timeout)

    result = await run_sequence(
        route,
        send,
        Deadline.start(start, route.timeout),
        Constraints(),
        clock,
        _Highest(),
        Recorder(),
        FakeSleepGate(clock),
    )
    return result.attempts, clock.monotonic() - start


async def time_out(clock: FakeClock, timeout: float):
    clock.advance(timeout)
    raise AttemptTimeout("simulated")


@pytest.mark.parametrize(
    ("retry", "timeout"),
    [
        ("{attempts: 4, per_try_timeout: 2s}", "10s"),
        ("{attempts: 5, per_try_timeout: 3s}", "10s"),  # the deadline cuts it
        (
            "{attempts: 10, per_try_timeout: 100ms, backoff: {strategy: exponential, base: 50ms, max: 1s}}",
            "30s",
        ),
        (
            "{attempts: 6, per_try_timeout: 1s, backoff: {strategy: decorrelated_jitter, base: 100ms, max: 2s}}",
            "60s",
        ),
    ],
)
async def test_worst_case_wall_clock_matches_the_driver(retry, timeout):
    route = route_of(retry, timeout)
    sim = simulate(route, Outcome(OutcomeKind.PER_TRY_TIMEOUT), route.retry.per_try_timeout)
    attempts, elapsed = await drive(route, time_out)
    assert elapsed == pytest.approx(sim.wall_clock)
    assert attempts == sim.attempts
    # explain reports the worst over every failure kind (a slow 503 with Retry-After may be worse)
    wc = worst_case(route)
    assert wc.wall_clock >= sim.wall_clock and wc.attempts >= attempts


async def test_worst_case_with_retry_after_matches_the_driver():
    route = route_of(
        "{attempts: 3, per_try_timeout: 1s, retry_on: [503], retry_after: {honor: true, max: 2s}}",
        "20s",
    )

    async def slow_503(clock: FakeClock, timeout: float):
        clock.advance(timeout)
        return FakeResponse(503, "120")

    wc = worst_case(route)
    attempts, elapsed = await drive(route, slow_503)
    # 3 slow attempts + 2 waits of 2 s (the cap) plus 10% upward jitter each.
    assert elapsed == pytest.approx(3 * 1.0 + 2 * 2.2)
    assert wc.wall_clock == pytest.approx(elapsed)
    assert attempts == wc.attempts == 3


def test_load_multipliers():
    route = route_of("{attempts: 3}")
    assert budget_multiplier(route, 3, 100.0) == pytest.approx(1.3)  # 0.2 + 10/100
    assert budget_multiplier(route, 3, 1.0) == 3.0  # capped by attempts
    assert stacked(3, 3, edge_only=False) == 27
    assert stacked(3, 3, edge_only=True) == 3


def test_explain_cli_prints_each_route():
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "explain", str(ROOT / "config" / "sidecar.yaml")],
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0
    assert "route orders" in res.stdout and "route default" in res.stdout
    assert "worst-case attempts per request:  4" in res.stdout
    assert "x64.00" in res.stdout  # 4 attempts naive over 3 tiers

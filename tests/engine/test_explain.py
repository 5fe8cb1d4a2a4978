"""explain's numbers come from the pure decide step; check them against the real async driver
(Driver.run) on a fake clock with every attempt failing."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sidecar.config.parse import parse_text
from sidecar.core import AttemptTimeout, Fate, UpstreamError
from sidecar.engine.attempted import Attempted, outcome_of
from sidecar.engine.loop import Driver
from sidecar.engine.sequence import shaped
from sidecar.outcomes import OutcomeKind
from sidecar.retry.classify import Outcome
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints
from sidecar.retry.endpoints import Endpoint
from sidecar.retry.worstcase import _Highest, budget_multiplier, simulate, stacked, worst_case
from sidecar.telemetry.events import Recorder
from sidecar.testing import FakeClock
from sidecar.upstream.client import UpstreamResponse
from sidecar.upstream.connection import Connection
from sidecar.upstream.pool import Pool, PoolSettings

ROOT = Path(__file__).resolve().parents[2]


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

    def allow_retry(self) -> Fate | None:
        return None

    def retry_unsent(self) -> None:
        pass

    def retry_sent(self) -> None:
        pass

    def allow_hedge(self) -> str | None:
        return None

    def draining(self) -> bool:
        return False

    async def sleep(self, delay: float) -> None:
        self.clock.advance(delay)


def fake_response(status: int, retry_after: str | None) -> UpstreamResponse:
    """A real response object with no connection behind it: under the compiled build the engine
    accepts nothing else, and a compiled class cannot be subclassed by a test."""
    loop = asyncio.get_running_loop()
    conn = Connection(loop, ("h", 1))
    conn.status = status
    conn.headers = [(b"retry-after", retry_after.encode())] if retry_after else []
    conn.retry_after = retry_after.encode() if retry_after else None  # as the parser notes it
    up = UpstreamResponse(Pool(loop, "h", 1, PoolSettings()), conn)
    up._done = True  # nothing to give back: no connection was ever made
    return up


class FakeAttempter:
    """Each attempt fails as ``fail`` says, on the fake clock; never hedged."""

    def __init__(self, clock: FakeClock, fail) -> None:
        self.clock = clock
        self.fail = fail
        self.endpoint = Endpoint("h", 1)

    def hedge_after(self) -> float | None:
        return None

    def reserve(self) -> None:
        return None  # never asked: this attempter is never hedged

    def pick(self, avoid) -> Endpoint:
        return self.endpoint

    async def attempt(
        self, number: int, hedge: bool, endpoint: Endpoint, timeout: float, reserved=None
    ):
        start = self.clock.monotonic()
        try:
            response = await self.fail(self.clock, timeout)
        except UpstreamError as exc:
            now = self.clock.monotonic()
            return Attempted(
                number, endpoint, hedge, start, now, Outcome(exc.kind), response=None, error=exc
            )
        now = self.clock.monotonic()
        return Attempted(
            number, endpoint, hedge, start, now, outcome_of(response), response=response
        )


async def drive(route, fail):
    clock = FakeClock()
    start = clock.monotonic()
    result = await shaped(
        Driver(
            route,
            FakeAttempter(clock, fail),
            Deadline.start(start, route.timeout),
            Constraints(),
            clock,
            _Highest(),
            events=Recorder(),
            gate=FakeSleepGate(clock),
        )
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
        return fake_response(503, "120")

    wc = worst_case(route)
    attempts, elapsed = await drive(route, slow_503)
    # 3 slow attempts + 2 waits of 2 s (the cap) plus 10% upward jitter each.
    assert elapsed == pytest.approx(3 * 1.0 + 2 * 2.2)
    assert wc.wall_clock == pytest.approx(elapsed)
    assert attempts == wc.attempts == 3


def test_load_multipliers():
    route = route_of("{attempts: 3}")
    assert budget_multiplier(route, 3, 100.0) == pytest.approx(1.6)  # 0.5 + 10/100
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


def test_explain_shows_every_storm_control_mechanism_and_its_off_switch():
    from sidecar.explain import explain_route

    on = "\n".join(explain_route(route_of("{attempts: 3}")))
    for fragment in (
        "per-try auto (2 x p95 of recent attempts, 50ms..10s; never abandoned)",
        "at 100 req/s at most 0.60 retries per request on average (attempts 3 alone would "
        "allow 2, as nginx's 3 tries do)",
        "adaptive throttle: retries and hedges refused with p = (attempts - 2 x accepted)",
        "20% at 60% failing",
        "hedging: off (opt-in per route: hedge: {enabled: true})",
        "breaker: opens when >= 0.95 of >= 20 sequences in 10s",
        "open 1s, doubled on each reopen up to 30s; half-open ramps traffic back over 1s",
        "concurrency: fixed bulkhead of 1000 sequences, queue 1s (adaptive limit: opt-in per "
        "route, bulkhead: {adaptive: true})",
        "endpoints: h:1",
        "kill switch: one attempt through the same path, none of the above",
    ):
        assert fragment in on, fragment
    adaptive = "\n".join(explain_route(route_of("{attempts: 3}\n    bulkhead: {adaptive: true}")))
    assert "concurrency: adaptive, 5..1000 upstream attempts in flight" in adaptive
    c = parse_text(
        "version: 1\nroutes:\n  - name: r\n    upstream: [http://a:1, http://b:2]\n"
        "    retry: {per_try_timeout: 2s}\n    throttle: {enabled: false}\n"
        "    hedge: {enabled: true}\n"
        "    breaker: {enabled: false}\n    bulkhead: {adaptive: false}\n"
    )
    off = "\n".join(explain_route(c.routes[0]))
    assert "per-try 2s (an attempt is abandoned then)" in off
    assert "adaptive throttle: off" in off and "breaker: off" in off
    assert "hedging: off (needs per_try_timeout: auto and attempts >= 2)" in off
    assert "concurrency: fixed bulkhead of 1000 sequences" in off
    assert "endpoints: a:1, b:2" in off


def test_explain_says_which_methods_a_route_hedges():
    from sidecar.explain import explain_route

    c = parse_text(
        "version: 1\nroutes:\n  - name: r\n    upstream: http://h:1\n"
        "    hedge: {enabled: true, methods: [GET, DELETE]}\n"
    )
    text = "\n".join(explain_route(c.routes[0]))
    assert "hedging: on for DELETE, GET (never with an Idempotency-Key)" in text


def test_explain_writes_each_setting_as_the_config_file_does():
    """explain prints a setting by its unit in the schema, as config/sidecar.yaml is rendered
    from it: the default deadline is ``timeout: 60s`` there and ``deadline 60s`` here (it was
    ``1m``); 1h stays ``1h`` (was ``60m``), 1500ms stays ``1500ms`` (was ``1.5s``)."""
    from sidecar.explain import explain_route

    example = (ROOT / "config" / "sidecar.yaml").read_text()
    assert re.search(r"^  timeout: 60s ", example, re.M)
    for route in parse_text(example).routes:
        assert "deadline 60s," in "\n".join(explain_route(route))
    c = parse_text(
        "version: 1\nroutes:\n  - name: r\n    upstream: http://h:1\n    timeout: 1h\n"
        "    retry: {attempts: 3, backoff: {base: 1500ms, max: 90s}}\n"
        "    breaker: {open_for: 2m, max_open_for: 1h}\n    budget: {window: 30s}\n"
    )
    out = "\n".join(explain_route(c.routes[0]))
    assert "deadline 1h, backoff full_jitter 1500ms..90s" in out
    assert "open 120s, doubled on each reopen up to 1h" in out
    assert "retry budget: ratio 0.5 + 10/s over 30s" in out

"""The fleet's Redis link: the pause before a failed Redis is asked again (pure, on a fake
clock), the password read from the variable ``password_env`` names, and a link to nothing that
fails within its timeout and then waits out its pause without touching the network."""

from __future__ import annotations

import asyncio

import pytest

from sidecar.config.fleet import FleetRedis
from sidecar.fleet.connection import (
    BACKOFF_FIRST,
    BACKOFF_MAX,
    FleetLink,
    FleetUnavailable,
    ReconnectPause,
    password,
)
from sidecar.fleet.report import ErrorReport
from sidecar.testing import FakeClock
from tests.proc import free_port


def test_the_pause_doubles_up_to_its_bound_and_a_success_ends_it() -> None:
    pause = ReconnectPause()
    assert pause.ready(0.0) and pause.connected
    delays = []
    for _ in range(8):
        pause.failed(100.0)
        delays.append(pause.delay())
        assert pause.next_try == 100.0 + pause.delay()
    assert delays[0] == BACKOFF_FIRST and delays[1] == 2 * BACKOFF_FIRST
    assert max(delays) == BACKOFF_MAX and delays == sorted(delays)
    assert not pause.ready(100.0 + BACKOFF_MAX - 0.01) and pause.ready(100.0 + BACKOFF_MAX)
    pause.succeeded()
    assert pause.ready(0.0) and pause.connected


def test_the_password_comes_from_the_variable_password_env_names() -> None:
    settings = FleetRedis(url="redis://h", password_env="P")
    assert password(settings, {"P": "s3cret"}) == "s3cret"
    assert password(settings, {"P": ""}) is None
    assert password(settings, {}) is None
    assert password(FleetRedis(url="redis://h", password_env=None), {"P": "x"}) is None


def test_a_link_to_nothing_fails_then_pauses_without_asking() -> None:
    clock = FakeClock()
    settings = FleetRedis(url=f"redis://127.0.0.1:{free_port()}/0", timeout=1.0)

    async def main() -> None:
        link = FleetLink(settings, clock)
        asked = 0

        async def ping(client: object) -> object:
            nonlocal asked
            asked += 1
            return await link.client.ping()

        try:
            with pytest.raises(FleetUnavailable, match="unreachable"):
                await link.call(ping)
            assert not link.connected and asked == 1
            with pytest.raises(FleetUnavailable, match="next try in"):
                await link.call(ping)
            assert asked == 1  # in the pause: not asked
            clock.advance(BACKOFF_MAX)
            with pytest.raises(FleetUnavailable):
                await link.call(ping)
            assert asked == 2
        finally:
            await link.close()

    asyncio.run(main())


def test_a_kind_of_failure_is_told_once_per_period_with_how_many_were_left_out() -> None:
    report = ErrorReport(every=30.0)
    assert report.failed("AuthenticationError", "WRONGPASS", 100.0) is not None
    assert report.failed("AuthenticationError", "WRONGPASS", 110.0) is None
    assert report.failed("TimeoutError", "did not answer in time", 111.0) is not None  # own kind
    assert report.failed("AuthenticationError", "WRONGPASS", 129.9) is None
    told = report.failed("AuthenticationError", "WRONGPASS", 130.0)
    assert told == "the fleet Redis failed: WRONGPASS (2 more like it since the last warning)"
    assert report.last == "WRONGPASS"
    report.succeeded()
    assert report.last is None

"""One view of every link to the fleet's Redis (sidecar/fleet/links.py): each use names its
link where it makes it, the view shows it under that name until it is closed, and the log
names the use in its warning and says once when the Redis answers again."""

from __future__ import annotations

import logging

import pytest

from sidecar.config.fleet import FleetRedis
from sidecar.core import Clock
from sidecar.fleet.connection import FleetLink, FleetUnavailable
from sidecar.fleet.links import FleetLinks, LinkState
from sidecar.fleet.report import ErrorReport
from tests.proc import free_port


def test_the_end_of_an_outage_is_told_once_after_its_warning() -> None:
    report = ErrorReport(every=30.0, subject="the fleet Redis (dlq)")
    assert report.succeeded() is None  # nothing was told: nothing to end
    assert report.failed("TimeoutError", "did not answer in time", 0.0) == (
        "the fleet Redis (dlq) failed: did not answer in time"
    )
    assert report.failed("TimeoutError", "did not answer in time", 1.0) is None  # rate limited
    assert report.succeeded() == "the fleet Redis (dlq) answers again"
    assert report.last is None and report.succeeded() is None  # once
    # A failure within the warning's period after that is not told, nor its end.
    assert report.failed("TimeoutError", "did not answer in time", 2.0) is None
    assert report.succeeded() is None


async def test_a_link_is_shown_under_its_use_until_it_is_closed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = FleetRedis(url=f"redis://127.0.0.1:{free_port()}/0", timeout=5.0)
    links = FleetLinks()
    dlq = links.add(FleetLink(refused, Clock(), use="dlq"), "writes get unavailable")
    keys = links.add(FleetLink(refused, Clock(), use="idempotency"), "on_store_error")
    try:
        assert links.states() == [
            LinkState("dlq", True, None, "writes get unavailable"),  # not asked yet
            LinkState("idempotency", True, None, "on_store_error"),
        ]
        with caplog.at_level(logging.WARNING, "sidecar.fleet"), pytest.raises(FleetUnavailable):
            await dlq.call(lambda r: r.ping())
        [state, other] = links.states()
        assert (state.use, state.state, other.state) == ("dlq", "unreachable", "connected")
        assert state.error is not None and "Error 111 connecting to" in state.error
        [warned] = [r.getMessage() for r in caplog.records if r.name == "sidecar.fleet"]
        assert warned.startswith("the fleet Redis (dlq) failed: Error 111 connecting to")
    finally:
        await dlq.close()
        assert [s.use for s in links.states()] == ["idempotency"]
        await keys.close()
    assert links.states() == []

"""The fleet tests' fixtures: a real redis-server per test, and the sidecar processes a test
started, each terminated by PID however the test ends."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from tests.proc import SidecarProcess
from tests.redisserver import RedisServer, running


@pytest.fixture
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    with running(tmp_path / "redis") as server:
        yield server


@pytest.fixture
async def procs() -> AsyncIterator[list[SidecarProcess]]:
    started: list[SidecarProcess] = []
    yield started
    for p in started:
        p.terminate()

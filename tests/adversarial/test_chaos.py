"""The invariant run of tests/chaos.py, bounded to about half a minute of traffic."""

from __future__ import annotations

import pytest

from tests import chaos

pytestmark = pytest.mark.slow


async def test_chaos_leaves_nothing_behind():
    report = await chaos.run(seconds=20.0, seed=11)
    assert report.requests > 1000, report  # the run really exercised the proxy
    assert report.upstream.get("reset", 0) > 0 and report.upstream.get("midbody", 0) > 0
    assert report.outcomes.get("abort", 0) > 0 and report.outcomes.get("upload", 0) > 0
    assert report.dlq_told > 0  # some writes were acknowledged through the DLQ
    assert report.problems == [], report.problems[:10]

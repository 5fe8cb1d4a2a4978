"""SIGKILL mid-stream must never lose an acknowledged DLQ record, on either store (a few rounds
here; bench/dlq.py runs 30 per store): the sidecar killed over its SQLite file or over the
fleet's Redis, and redis-server itself killed and restarted under the sidecar's writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.dlq_crash import redis_store, run_rounds
from tests.redisserver import running


async def test_acknowledged_records_survive_sigkill(tmp_path: Path) -> None:
    results = await run_rounds(3, tmp_path)
    assert sum(r.acknowledged for r in results) > 0
    assert [r.lost for r in results] == [0, 0, 0]
    assert [r.corrupted for r in results] == [0, 0, 0]


@pytest.mark.slow
async def test_acknowledged_records_survive_sigkill_on_redis(tmp_path: Path) -> None:
    with running(tmp_path / "redis") as server:
        store = redis_store(server)
        sidecar = await run_rounds(2, tmp_path, store=store)
        redis = await run_rounds(1, tmp_path, store=store, kill="redis")
    assert all(r.acknowledged > 0 for r in sidecar + redis)
    assert [(r.lost, r.corrupted) for r in sidecar + redis] == [(0, 0)] * 3
    assert redis[0].acknowledged_after_restart > 0  # it took writes again once Redis was back

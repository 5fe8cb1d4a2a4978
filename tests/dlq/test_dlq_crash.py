"""SIGKILL mid-stream must never lose an acknowledged DLQ record (a few rounds here;
bench/dlq.py runs 30)."""

from __future__ import annotations

from bench.dlq_crash import run_rounds


async def test_acknowledged_records_survive_sigkill(tmp_path):
    results = await run_rounds(3, tmp_path)
    assert sum(r.acknowledged for r in results) > 0
    assert [r.lost for r in results] == [0, 0, 0]
    assert [r.corrupted for r in results] == [0, 0, 0]

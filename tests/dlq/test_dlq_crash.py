"""SIGKILL mid-stream must never lose an acknowledged DLQ record, on either store (a few rounds
here; bench/dlq.py runs 30 per store): the sidecar killed over its SQLite file or over the
fleet's Redis, and redis-server itself killed and restarted under the sidecar's writes."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from bench.dlq_crash import SQLITE, failing_upstream, one_round, redis_store, run_rounds
from tests.redisserver import running
from tests.wait import until


@pytest.mark.slow  # a real sidecar SIGKILLed over several rounds: the full tier
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


def processes_with(text: str) -> list[int]:
    """The pids of the processes whose command line holds ``text``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text in cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                pids.append(int(cmdline.parent.name))
        except OSError:
            continue  # ended meanwhile
    return pids


async def test_a_round_cancelled_mid_stream_leaves_no_sidecar_and_no_writer(
    tmp_path: Path,
) -> None:
    runner, up_port = await failing_upstream()
    try:
        task = asyncio.create_task(one_round(tmp_path, up_port, kill_after=600))

        def stored() -> bool:
            if not (tmp_path / "dlq.sqlite3").exists():
                return False  # not before the sidecar made it (a connect would create it)
            try:
                return len(SQLITE.read(tmp_path)) > 0
            except sqlite3.Error:
                return False  # its schema not made yet

        await until(stored, "records stored while the writers run")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await runner.cleanup()
    assert processes_with(str(tmp_path / "sidecar.yaml")) == []
    assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []

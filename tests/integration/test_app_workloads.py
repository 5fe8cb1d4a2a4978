"""Real workloads as real processes, each run three ways in one test -- direct, through the
real sidecar process with its shipped defaults, and through nginx as a reverse proxy -- against
a fresh app each way: the sidecar's outcome, its successes and refusals and the handler runs
the app counted must equal direct's. nginx's must too (it shows the workload is one a proxy can
pass unchanged); without nginx that third way is skipped, saying so, after the other two."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests import gitapp, motoapp, sioapp
from tests.difftools import stop
from tests.proc import free_port
from tests.threeways import WAYS, Tally, front, nginx_available

pytestmark = pytest.mark.slow


def comparable(t: Tally) -> dict[str, object]:
    return {
        "outcome": t.outcome,
        "answered": t.answered,
        "refused": t.refused,
        "handled": t.handled,
    }


def check_ways(tallies: dict[str, Tally], expect: Callable[[Tally], None]) -> None:
    """Direct is what the app gives (checked by ``expect``); every other way must equal it."""
    direct = tallies["direct"]
    expect(direct)
    for way, t in tallies.items():
        assert comparable(t) == comparable(direct), f"{way} differs from direct: {tallies}"
    if "nginx" not in tallies:
        pytest.skip("nginx is not installed: direct and sidecar compared, nginx not run")


def ways() -> list[str]:
    return [w for w in WAYS if w != "nginx" or nginx_available()]


async def test_git_push_and_clone_of_a_20_mib_blob(tmp_path: Path) -> None:
    """dulwich's smart-HTTP server under gunicorn: ``git push`` (chunked: the pack is over
    git's 1 MiB http.postBuffer) and ``git clone`` of a repository with a 20 MiB blob."""
    commit = gitapp.make_source(tmp_path)
    tallies: dict[str, Tally] = {}
    for way in ways():
        root = tmp_path / f"server-{way}"
        port = free_port()
        app = gitapp.start(port, root)
        try:
            async with front(way, port, tmp_path / f"front-{way}") as p:
                tallies[way] = gitapp.run(f"http://127.0.0.1:{p}", port, tmp_path, commit)
        finally:
            stop(app)

    def expect(t: Tally) -> None:
        assert t.outcome["push"] is True and t.outcome["clone"] is True, t.outcome
        assert t.outcome["head_is_pushed_commit"] is True and t.outcome["blob_intact"] is True
        assert t.refused == 0

    check_ways(tallies, expect)


async def test_s3_and_sqs_on_moto_through_boto3(tmp_path: Path) -> None:
    """moto's server driven by boto3 (its own retries off): bucket, objects put, read and
    deleted, a 15 MiB multipart upload; a queue sent to, long-poll received and emptied."""
    tallies: dict[str, Tally] = {}
    for way in ways():
        port = free_port()
        app = motoapp.start(port)
        try:
            async with front(way, port, tmp_path / f"front-{way}") as p:
                tallies[way] = motoapp.run(f"http://127.0.0.1:{p}", port)
        finally:
            stop(app)

    def expect(t: Tally) -> None:
        assert t.outcome["failed operations"] == [], t.outcome
        assert t.outcome["small objects read back"] is True
        assert t.outcome["multipart object intact"] is True
        assert t.outcome["messages received"] == sorted(motoapp.MESSAGES)
        assert t.handled["S3 PUT uploadId,partNumber"] == motoapp.PARTS

    check_ways(tallies, expect)


async def test_socketio_over_long_polling(tmp_path: Path) -> None:
    """A Socket.IO session over HTTP long-polling only: every tick the server pushes and every
    echo arrive, each echo handler runs once, and the app refuses no poll."""
    tallies: dict[str, Tally] = {}
    for way in ways():
        async with (
            sioapp.server() as (port, counts),
            front(way, port, tmp_path / f"front-{way}") as p,
        ):
            tallies[way] = await sioapp.run(f"http://127.0.0.1:{p}", counts)

    def expect(t: Tally) -> None:
        assert t.outcome["ticks"] == list(range(sioapp.TICKS)), t.outcome
        assert t.outcome["echoes"] == list(range(sioapp.ECHOES)), t.outcome
        assert t.outcome["app refusals"] == {}, t.outcome
        assert t.handled == {"connect": 1, "echo": sioapp.ECHOES, "start": 1}

    check_ways(tallies, expect)

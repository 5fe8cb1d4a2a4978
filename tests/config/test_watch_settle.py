"""The file watcher loads an edit once its bytes have stayed the same for one more poll: a
file rewritten in place in two writes is never served half-written."""

from __future__ import annotations

import asyncio
import hashlib
import os
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import aiohttp

from sidecar.config.watch import SETTLE, Pending, settle_step, settle_wait
from tests.conftest import reply
from tests.proc import start_process
from tests.wait import until


async def test_a_file_rewritten_in_two_writes_is_not_loaded_half_written(
    upstream_factory, tmp_path: Path
) -> None:
    """Outside finding: the valid first half of an in-place rewrite was loaded, and 46 of 111
    requests got 404 for a route the half did not have yet (1.2 s). The real process, its
    watcher at its shipped 0.5 s: the first half is written, the watcher sees it (its log
    line; on the old code, the half loaded), the rest is written, and no request sent all
    the while found the route missing."""
    up = await upstream_factory(reply(200))
    routes = (
        "routes:\n"
        f'  - name: a\n    match: {{path_prefix: /a}}\n    upstream: "{up.url}"\n'
        f'  - name: b\n    match: {{path_prefix: /b}}\n    upstream: "{up.url}"\n'
    )
    proc, port, admin = await start_process(tmp_path, routes)
    cfg = proc.config_path
    whole = cfg.read_text() + "# edited\n"
    half = whole[: whole.index("  - name: b")]  # valid on its own: route b missing
    statuses: list[int] = []
    stop = asyncio.Event()

    async def version(s: aiohttp.ClientSession) -> str:
        async with s.get(f"http://127.0.0.1:{admin}/config") as resp:
            return str((await resp.json())["version"])

    async def hammer(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with s.get(f"http://127.0.0.1:{port}/b") as resp:
                statuses.append(resp.status)
            await asyncio.sleep(0.005)

    try:
        async with aiohttp.ClientSession() as s:
            task = asyncio.create_task(hammer(s))
            try:
                await until(lambda: len(statuses) >= 5, "requests to flow")
                seen = proc.stderr().count("config file changed")
                with cfg.open("w") as f:  # in place: truncate, then two writes
                    f.write(half)
                    f.flush()
                    loaded_half = False

                    async def watcher_saw_half() -> bool:
                        nonlocal loaded_half
                        loaded_half = await version(s) == hashlib.sha256(half.encode()).hexdigest()
                        return loaded_half or proc.stderr().count("config file changed") > seen

                    for _ in range(1500):  # bounded: 15 s
                        if await watcher_saw_half():
                            break
                        await asyncio.sleep(0.01)
                    else:
                        raise AssertionError("the watcher never saw the first half")
                    f.write(whole[len(half) :])
                want = hashlib.sha256(whole.encode()).hexdigest()
                for _ in range(1500):
                    if await version(s) == want:
                        break
                    await asyncio.sleep(0.01)
                else:
                    raise AssertionError("the whole file was never loaded")
                before = len(statuses)
                await until(lambda: len(statuses) >= before + 5, "requests after the load")
            finally:
                stop.set()
                await task
    finally:
        proc.terminate()
    assert not loaded_half
    assert statuses.count(404) == 0 and set(statuses) == {200}, statuses


async def _hammer_while(
    port: int, admin: int, rewrite: Callable[[aiohttp.ClientSession], Awaitable[str]]
) -> tuple[list[int], bool]:
    """Requests to /b all the while ``rewrite`` runs (it returns the hash of the whole file),
    then until the whole file is loaded: the statuses, and whether another version than the
    old and the whole one was ever served."""
    statuses: list[int] = []
    versions: set[str] = set()
    stop = asyncio.Event()

    async def version(s: aiohttp.ClientSession) -> str:
        async with s.get(f"http://127.0.0.1:{admin}/config") as resp:
            return str((await resp.json())["version"])

    async def hammer(s: aiohttp.ClientSession) -> None:
        while not stop.is_set():
            async with s.get(f"http://127.0.0.1:{port}/b") as resp:
                statuses.append(resp.status)
            versions.add(await version(s))
            await asyncio.sleep(0.005)

    async with aiohttp.ClientSession() as s:
        old = await version(s)
        task = asyncio.create_task(hammer(s))
        try:
            await until(lambda: len(statuses) >= 5, "requests to flow")
            want = await rewrite(s)
            for _ in range(1500):  # bounded: 15 s
                if await version(s) == want:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the whole file was never loaded")
            before = len(statuses)
            await until(lambda: len(statuses) >= before + 5, "requests after the load")
        finally:
            stop.set()
            await task
    return statuses, bool(versions - {old, want})


def _two_routes(url: str) -> str:
    return (
        "routes:\n"
        f'  - name: a\n    match: {{path_prefix: /a}}\n    upstream: "{url}"\n'
        f'  - name: b\n    match: {{path_prefix: /b}}\n    upstream: "{url}"\n'
    )


async def test_an_in_place_rewrite_pausing_1_2s_between_writes_is_not_loaded_half_written(
    upstream_factory, tmp_path: Path
) -> None:
    """Finding 15, as reported: a file rewritten in place with a 1.2 s pause between two
    writes (the first half valid YAML, route b missing) was loaded, and 46 of 111 requests got
    404. The real process, its watcher as shipped (0.5 s polls, in-place bytes loaded once
    unchanged for 2 s): the half is never served."""
    up = await upstream_factory(reply(200))
    proc, port, admin = await start_process(tmp_path, _two_routes(up.url))
    cfg = proc.config_path
    whole = cfg.read_text() + "# edited in place\n"
    half = whole[: whole.index("  - name: b")]

    async def rewrite(s: aiohttp.ClientSession) -> str:
        with cfg.open("w") as f:  # in place: truncate, write, pause, write
            f.write(half)
            f.flush()
            await asyncio.sleep(1.2)
            f.write(whole[len(half) :])
        return hashlib.sha256(whole.encode()).hexdigest()

    try:
        statuses, other = await _hammer_while(port, admin, rewrite)
    finally:
        proc.terminate()
    assert not other, "a version other than the old and the whole file was served"
    assert statuses.count(404) == 0 and set(statuses) == {200}, statuses


async def test_a_rename_based_rewrite_never_shows_a_half_state(
    upstream_factory, tmp_path: Path
) -> None:
    """What docs/operating.md tells a writer to do (as a ConfigMap's ``..data`` swap): write the new
    file beside it, as slowly as it likes (two writes 1.2 s apart here), then rename it over
    the old one. Under live traffic, no request sees a half state, and the new file is loaded
    after one poll."""
    up = await upstream_factory(reply(200))
    proc, port, admin = await start_process(tmp_path, _two_routes(up.url))
    cfg = proc.config_path
    whole = cfg.read_text() + "# written beside, renamed over\n"
    half = whole[: whole.index("  - name: b")]

    async def rewrite(s: aiohttp.ClientSession) -> str:
        tmp = cfg.with_name(".sidecar.yaml.tmp")
        with tmp.open("w") as f:
            f.write(half)
            f.flush()
            await asyncio.sleep(1.2)
            f.write(whole[len(half) :])
        os.replace(tmp, cfg)
        return hashlib.sha256(whole.encode()).hexdigest()

    try:
        statuses, other = await _hammer_while(port, admin, rewrite)
    finally:
        proc.terminate()
    assert not other
    assert set(statuses) == {200}, statuses


# The decision, pure, on a fake clock: what is and is not loaded.

IN_PLACE = (7, 100, 10, 100, 1, "/etc/sidecar.yaml")  # inode ... resolved path


def _polls(events: Sequence[tuple[float, str, tuple[object, ...]]], wait: float) -> list[float]:
    """The times at which the watcher would load, polling at each event's time."""
    pending: Pending | None = None
    loads = []
    for now, sha, stat in events:
        pending, ready = settle_step(pending, sha, stat, now, wait)
        if ready:
            loads.append(now)
            pending = None
    return loads


def test_settle_in_place_waits_for_bytes_and_stat_to_stand_still() -> None:
    half, whole = "h" * 64, "w" * 64
    grown = (7, 200, 20, 200, 1, "/etc/sidecar.yaml")
    wait = settle_wait(IN_PLACE, grown, SETTLE)
    assert wait == SETTLE == 2.0
    # The half stands 1.5 s (under the settle window), then the whole: only the whole loads.
    polls = [(t / 2, half, IN_PLACE) for t in range(1, 4)]
    polls += [(t / 2, whole, grown) for t in range(4, 10)]
    assert _polls(polls, wait) == [4.0]  # first seen at 2.0, unchanged for 2 s
    # The same bytes with a new stat (touched, rewritten identically) start the wait again.
    touched = (7, 300, 20, 300, 1, "/etc/sidecar.yaml")
    polls = [(0.5, whole, grown), (1.0, whole, grown), (1.5, whole, touched), (3.0, whole, touched)]
    assert _polls(polls, wait) == []
    assert _polls([*polls, (3.5, whole, touched)], wait) == [3.5]


def test_settle_documented_limit_and_a_rename() -> None:
    """The limit docs/operating.md "Hot reload" states: a writer pausing longer than the window in
    place can be loaded half-written. A file renamed into place loads at the next poll."""
    half = "h" * 64
    assert _polls([(t / 2, half, IN_PLACE) for t in range(1, 7)], SETTLE) == [2.5]
    renamed = (8, 100, 10, 100, 2, "/etc/sidecar.yaml")
    symlink_swap = (9, 100, 10, 100, 2, "/etc/..2025_01_01/sidecar.yaml")
    for stat in (renamed, symlink_swap):
        wait = settle_wait(IN_PLACE, stat, SETTLE)
        assert wait == 0.0
        assert _polls([(0.5, half, stat), (1.0, half, stat)], wait) == [1.0]

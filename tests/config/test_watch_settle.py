"""The file watcher loads an edit once its bytes have stayed the same for one more poll: a
file rewritten in place in two writes is never served half-written."""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

import aiohttp

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

"""The real sidecar process takes its start-up heap out of full garbage collections once it
listens (``sidecar/heapfreeze.py``): a full collection on the loop then traverses only what came
after, not the ~50,000 objects the process keeps for its life."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

from tests.proc import start_process
from tests.wait import until

FROZEN = re.compile(r"start-up heap frozen: (\d+) objects")


def test_the_started_process_freezes_its_start_up_heap(tmp_path: Path) -> None:
    async def main() -> None:
        proc, _, _ = await start_process(
            tmp_path, 'routes:\n  - name: r\n    upstream: "http://127.0.0.1:9"\n'
        )
        try:
            await until(lambda: FROZEN.search(proc.stderr()), "the freeze's log line")
            found = FROZEN.search(proc.stderr())
            assert found is not None
            assert int(found.group(1)) > 10_000  # the start-up heap, not a handful
        finally:
            proc.terminate()

    asyncio.run(main())

"""The shared helpers of the tests (tests/*.py) do what the tests that use them rely on: a
process killed at its line and reaped, a server gone on every exit."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest
from aiohttp import web

from tests.proc import run_until_line_then_kill
from tests.webserver import serve

# Writes its PID to the first file named, prints other output, then the line; were it let go
# rather than killed (its stdin closed), it would write the second file before exiting.
UNTIL_KILLED = """
import os, sys
open(sys.argv[1], "w").write(str(os.getpid()))
print("warming up", flush=True)
print("ready", flush=True)
sys.stdin.readline()
open(sys.argv[2], "w").write("exited cleanly")
"""


def test_run_until_line_then_kill_reads_past_other_lines_then_kills_and_reaps(tmp_path):
    pid_file, after = tmp_path / "pid", tmp_path / "after"
    run_until_line_then_kill(UNTIL_KILLED, str(pid_file), str(after), line=b"ready\n")
    assert not after.exists()  # SIGKILLed at the line, not let go
    with pytest.raises(ProcessLookupError):  # and reaped: no zombie left under its PID
        os.kill(int(pid_file.read_text()), 0)


def test_run_until_line_then_kill_fails_when_the_process_ends_without_the_line():
    with pytest.raises(AssertionError, match="warming up"):
        run_until_line_then_kill('print("warming up")', line=b"ready\n")


async def test_serve_answers_every_path_then_is_gone_after_an_exception_with_a_handler_held():
    """The port is closed once the block is left by an exception, and a handler still running
    then has been cancelled (the server's 0.2 s grace), not left behind."""
    entered = asyncio.Event()
    cancelled = asyncio.Event()

    async def handle(request: web.Request) -> web.StreamResponse:
        if request.path == "/hold":
            entered.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return web.Response(text=f"{request.method} {request.path}")

    async with aiohttp.ClientSession() as client:
        with pytest.raises(RuntimeError, match="the test failed"):
            async with serve(handle) as port:
                async with client.put(f"http://127.0.0.1:{port}/any/path") as r:
                    assert (r.status, await r.text()) == (200, "PUT /any/path")
                held = asyncio.create_task(client.get(f"http://127.0.0.1:{port}/hold"))
                await entered.wait()
                raise RuntimeError("the test failed")
        assert cancelled.is_set()
        with pytest.raises(aiohttp.ClientError):
            await held
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", port)

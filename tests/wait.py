"""Bounded waits for tests: poll for the exact condition a test needs next, never sleep a
guessed time. The bound only turns a hang into a failure; it is generous because CI runs on a
loaded machine, and it is never a timing assertion (a test that checks that something does
NOT happen by some time says so itself)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

BOUND = 15.0


async def until(condition: Callable[[], object], what: str, timeout: float = BOUND) -> None:
    """Return as soon as ``condition()`` is true; fail with ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.01)


async def until_async(
    condition: Callable[[], Awaitable[object]], what: str, timeout: float = BOUND
) -> None:
    """``until`` for a condition that must be awaited (an HTTP call, say), asked every 0.1 s."""
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(0.1)

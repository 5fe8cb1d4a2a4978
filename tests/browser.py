"""Debian's chromium driven by Playwright, for the status page's browser test and screenshot.

Never downloads a browser: it uses the system one through ``executable_path``, with an empty
profile directory, no sandbox (tests run as root in a container), no GPU, no QUIC and none of
the browser's own background traffic.
"""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from playwright.async_api import BrowserContext

ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


def why_not() -> str | None:
    """None when a browser test can run, else the reason to skip."""
    try:
        import playwright.async_api  # noqa: F401
    except ImportError:
        return "Playwright is not installed (pip install -e '.[test]')"
    if chromium_path() is None:
        return "no chromium on PATH (Debian: apt-get install chromium)"
    return None


@asynccontextmanager
async def browser(
    profile: Path, javascript: bool = False, width: int = 1400, height: int = 900
) -> AsyncIterator[BrowserContext]:
    from playwright.async_api import async_playwright

    path = chromium_path()
    assert path is not None
    profile.mkdir(parents=True, exist_ok=True)
    async with async_playwright() as p:
        ctx = await p.chromium.launch_persistent_context(
            str(profile),  # the empty --user-data-dir
            executable_path=path,
            headless=True,
            args=ARGS,
            java_script_enabled=javascript,
            viewport={"width": width, "height": height},
        )
        try:
            yield ctx
        finally:
            await ctx.close()

"""Giving the C heap's freed pages back to the system after large bodies have passed.

Why: 1 MiB bodies stream through the sidecar in buffers of 64-256 KiB (the client's reads, the
upstream's reads, the transports' write buffers). Once the first of them is freed, glibc's
malloc raises its dynamic mmap threshold above their size and serves the rest from its heap;
when the bodies end, that freed space sits between small blocks that stay alive, the heap cannot
shrink from its top, and the process keeps ~8-10 MB it no longer uses. ``malloc_trim(0)``
returns the whole free pages inside the heap too (madvise MADV_DONTNEED), and costs one walk
over malloc's free lists (well under a millisecond for the sidecar's heap).

How: a background task reads the process's RSS (/proc/self/statm) every INTERVAL seconds and
trims when it is SLACK bytes or more above the RSS the sidecar had once started. Nothing runs per
request; a sidecar whose RSS stays near its start (small requests) never trims nor imports
ctypes; a trim costs ~0.1 ms when there is nothing to give back (measured), a few ms when it
gives back tens of MB, so even a sidecar whose live memory stays above the mark (many idle
connections) pays ~0.1 ms every INTERVAL. Under a sustained large-body load the pages given
back are faulted in again (a few microseconds per 4 KiB page, at most once per INTERVAL):
noise next to moving the bytes, and measured so (bench/perf.py's 1 MiB figures).

Rejected: a fixed ``MALLOC_MMAP_THRESHOLD_`` (64 or 128 KiB) also gives the memory back, but
makes every such buffer an mmap/munmap pair and halved 1 MiB streaming throughput.

glibc only: on another C library (musl, macOS), or a Python without ctypes, ``malloc_trim`` is
absent and nothing runs.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

log = logging.getLogger("sidecar")

INTERVAL = 5.0
SLACK = 2 * 1024 * 1024


def rss_bytes() -> int | None:
    """The process's resident set, or None where /proc is absent."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def glibc_malloc_trim() -> Callable[[], None] | None:
    """glibc's ``malloc_trim(0)`` as a callable, or None when the C library has none. Imports
    ctypes (some 0.4 MB), so it is called only once a trim is due. A Python built without
    ctypes (no _ctypes module) has no trim either: absent, not a failed task."""
    try:
        import ctypes

        fn = ctypes.CDLL(None).malloc_trim  # the process's own symbols: its C library's
    except (ImportError, OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int

    def trim() -> None:
        fn(0)

    return trim


class HeapTrimmer:
    """When to trim, decided from RSS readings alone (the reading and the trim are injected):
    the first reading, taken once the sidecar has started and before any traffic, is the
    baseline; a later one ``slack`` bytes above it trims."""

    def __init__(
        self,
        rss: Callable[[], int | None] = rss_bytes,
        trim_factory: Callable[[], Callable[[], None] | None] = glibc_malloc_trim,
        slack: int = SLACK,
    ) -> None:
        self._rss = rss
        self._trim_factory: Callable[[], Callable[[], None] | None] | None = trim_factory
        self._trim: Callable[[], None] | None = None
        self._slack = slack
        self.baseline: int | None = None
        self.trims = 0

    def check(self) -> bool:
        """One look; True when it trimmed."""
        now = self._rss()
        if now is None:
            return False
        if self.baseline is None:
            self.baseline = now
            return False
        if now - self.baseline < self._slack:
            return False
        if self._trim is None:
            if self._trim_factory is None:
                return False  # this C library has no malloc_trim (looked up once)
            self._trim = self._trim_factory()
            self._trim_factory = None
            if self._trim is None:
                return False
        self._trim()
        self.trims += 1
        log.debug("heap trimmed at RSS %d bytes (%d once started)", now, self.baseline)
        return True

    async def run(self, interval: float = INTERVAL) -> None:
        self.check()  # the baseline
        while True:
            await asyncio.sleep(interval)
            self.check()

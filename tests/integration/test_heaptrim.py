"""Giving freed heap pages back after large bodies (sidecar/heaptrim.py): the decision with
injected readings, the real glibc ``malloc_trim`` on a really fragmented heap, and the task's
ownership in the running sidecar."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest

from sidecar.heaptrim import SLACK, HeapTrimmer, glibc_malloc_trim, rss_bytes
from tests.conftest import reply, routes_yaml

MB = 1024 * 1024


class Fake:
    def __init__(self, *readings: int | None) -> None:
        self.readings = list(readings)
        self.trims = 0
        self.lookups = 0

    def rss(self) -> int | None:
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]

    def factory(self):
        self.lookups += 1
        return self.trim

    def trim(self) -> None:
        self.trims += 1


def test_trims_only_above_the_started_rss_plus_the_slack():
    f = Fake(40 * MB, 41 * MB, 40 * MB + SLACK - 1, 40 * MB + SLACK, 50 * MB, 41 * MB, 40 * MB)
    t = HeapTrimmer(f.rss, f.factory)
    assert t.check() is False and t.baseline == 40 * MB  # the first reading: the baseline
    assert t.check() is False  # small growth (a few connections): left alone
    assert t.check() is False
    assert f.lookups == 0  # ctypes not even imported while nothing is due
    assert t.check() is True  # at the mark: trimmed
    assert t.check() is True  # still above: trimmed again, the lookup kept
    assert t.check() is False
    assert (f.trims, f.lookups, t.trims) == (2, 1, 2)
    assert t.baseline == 40 * MB  # the baseline never moves


def test_no_malloc_trim_in_the_c_library_means_no_trim_and_one_lookup():
    lookups = []

    def missing():
        lookups.append(1)
        return None

    readings = iter([10 * MB] + [100 * MB] * 5)
    t = HeapTrimmer(lambda: next(readings), missing)
    assert [t.check() for _ in range(6)] == [False] * 6
    assert len(lookups) == 1 and t.trims == 0


def test_no_proc_means_no_decision():
    t = HeapTrimmer(lambda: None, lambda: pytest.fail("looked up"))
    assert t.check() is False and t.baseline is None


def test_rss_reading_is_the_kernels():
    rss = rss_bytes()
    if rss is None:
        pytest.skip("no /proc/self/statm here")
    with open("/proc/self/status") as f:
        vmrss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(rss - vmrss) < 8 * MB  # two readings of the same process, moments apart


# The situation the trimmer exists for, on the real allocator: 1 MiB bodies leave 200 KiB
# buffers freed between small blocks that stay alive. Run in a fresh interpreter (no MALLOC_*
# tuning inherited) so the heap is the one glibc makes by default.
FRAGMENT = textwrap.dedent("""
    import sys
    from sidecar.heaptrim import glibc_malloc_trim, rss_bytes
    trim = glibc_malloc_trim()
    if trim is None:
        print("absent"); sys.exit(0)
    first = bytes(300_000); del first  # glibc raises its mmap threshold past this size
    big, live = [], []
    for _ in range(200):
        big.append(bytes(200_000))
        live.append(bytearray(2000))
    del big
    before = rss_bytes()
    trim()
    print(before, rss_bytes())
""")


def test_glibc_malloc_trim_gives_back_a_fragmented_heap():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "PYTHONMALLOC"))}
    out = subprocess.run(
        [sys.executable, "-c", FRAGMENT], env=env, capture_output=True, text=True, check=True
    ).stdout.split()
    if out == ["absent"]:
        pytest.skip("this C library has no malloc_trim (not glibc)")
    before, after = int(out[0]), int(out[1])
    assert before - after > 20 * MB, (before, after)  # of the 40 MB freed, most comes back


def test_glibc_malloc_trim_lookup_matches_the_platform():
    trim = glibc_malloc_trim()
    libc = os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else None
    assert (trim is not None) == bool(libc and libc.startswith("glibc")), libc


def test_a_python_without_ctypes_means_no_trim_not_a_failed_task(monkeypatch):
    """A Python built without _ctypes (a minimal or embedded build): the trim is absent, as
    on a C library without malloc_trim, instead of an ImportError that ends the task."""
    monkeypatch.setitem(sys.modules, "ctypes", None)  # ``import ctypes`` raises ImportError
    assert glibc_malloc_trim() is None
    readings = iter([10 * MB] + [100 * MB] * 3)
    t = HeapTrimmer(lambda: next(readings))
    assert [t.check() for _ in range(4)] == [False] * 4 and t.trims == 0


async def test_cancelled_half_way_the_task_ends_and_trims_nothing_more():
    f = Fake(40 * MB, 100 * MB)
    t = HeapTrimmer(f.rss, f.factory)
    task = asyncio.create_task(t.run(interval=3600))
    await asyncio.sleep(0)  # the baseline is read, then it sleeps
    assert t.baseline == 40 * MB
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert f.trims == 0


async def test_the_trim_task_reads_its_baseline_once_started(upstream_factory):
    """Named, listed and cancelled on stop like every background task: see
    test_status_page::test_every_background_task_is_named_listed_and_cancelled_on_stop."""
    from sidecar.app import Sidecar
    from sidecar.config.parse import parse_text

    up = await upstream_factory(reply(200))
    sc = Sidecar(parse_text(routes_yaml(up.url)))
    await sc.start()
    try:
        await asyncio.sleep(0)
        assert sc.heap.baseline is not None  # read once started
    finally:
        await sc.stop()

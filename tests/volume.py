"""A small real filesystem for tests that need a volume to fill up: a tmpfs mounted for the
test and unmounted whatever happens; the test is skipped, saying why, where mounting is not
possible (not root, no mount(8), a container without CAP_SYS_ADMIN)."""

from __future__ import annotations

import contextlib
import errno
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_volume(path: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``2m``) at ``path`` for the body of the ``with``."""
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) here to make a small volume")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs for a small volume: {res.stderr.strip()}")
    try:
        yield path
    finally:
        # Lazy: a process of the test that still holds a file there must not keep it mounted.
        subprocess.run(["umount", "-l", str(path)], check=True)


def fill(volume: Path) -> Path:
    """Write a filler file until the volume is full (ENOSPC); returns it, to free the space
    by deleting it."""
    filler = volume / "filler"
    with open(filler, "wb", buffering=0) as f:
        for chunk in (65536, 4096, 512, 1):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler

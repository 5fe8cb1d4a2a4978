"""ruff and mypy are part of the test command, so the README's one command checks them too."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_is_clean():
    res = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "sidecar", "tests", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.slow
def test_mypy_is_clean():
    res = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr

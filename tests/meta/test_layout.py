"""The tests mirror the source: every test module lives in a folder named for a package of
sidecar/ (``tests/proxy/`` for ``sidecar/proxy/``) or for a kind of test that spans them
(``integration``, ``differential``, ``adversarial``, ``meta``), and every package of sidecar/ has its
folder with at least one test in the quick tier. Shared helpers stay at ``tests/`` top level."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
# Folders for tests that are not about one package: the real process end to end (and what
# ships it), suites that compare against real apps and clients, hostile and random traffic,
# and the repository's own rules.
ACROSS = ("integration", "differential", "adversarial", "meta")


def packages() -> list[str]:
    return sorted(p.parent.name for p in (ROOT / "sidecar").glob("*/__init__.py"))


def test_every_test_module_lives_in_a_package_folder_or_a_folder_across_them():
    allowed = set(packages()) | set(ACROSS)
    misplaced = [
        str(p.relative_to(TESTS))
        for p in sorted(TESTS.rglob("test_*.py"))
        if len(p.relative_to(TESTS).parts) != 2 or p.parent.name not in allowed
    ]
    assert misplaced == [], f"move these into tests/<package>/ or one of {ACROSS}: {misplaced}"


def test_every_test_folder_is_a_package_of_the_tests():
    """``from tests.<folder>.test_x import ...`` works, and two folders may hold modules of the
    same name."""
    folders = {p.parent for p in TESTS.rglob("test_*.py")}
    assert (
        sorted(str(f.relative_to(TESTS)) for f in folders if not (f / "__init__.py").is_file())
        == []
    )


def test_every_package_of_sidecar_has_a_folder_with_a_quick_test():
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    quick = {line.split("/")[1] for line in res.stdout.splitlines() if line.startswith("tests/")}
    missing = [p for p in packages() if p not in quick]
    assert missing == [], f"no quick-tier test in tests/<package>/ for: {missing}"


def test_no_test_folder_shadows_a_shared_helper():
    """A folder ``tests/x/`` is imported in place of the helper ``tests/x.py`` (a package wins
    over a module of the same name), so ``from tests import x`` would stop finding its code."""
    helpers = {p.stem for p in TESTS.glob("*.py")}
    folders = {p.parent.name for p in TESTS.rglob("test_*.py")}
    assert sorted(helpers & folders) == []

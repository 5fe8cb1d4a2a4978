"""Which build runs: pure Python or the hot path compiled with mypyc (setup.py)."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sidecar
from sidecar import core


def test_version_names_the_build_that_runs():
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    compiled = not (core.__file__ or "").endswith(".py")
    assert (
        out == f"retry-sidecar {sidecar.__version__} ({'compiled' if compiled else 'pure'} build)"
    )


def test_the_build_ci_asked_for_is_the_one_tested():
    """.ci/run runs the suite twice and says which build each pass must exercise: a compiled
    pass that silently imported the pure modules would prove nothing."""
    expected = os.environ.get("RETRY_SIDECAR_EXPECT_BUILD")
    if expected is None:
        pytest.skip("RETRY_SIDECAR_EXPECT_BUILD not set: a developer's run, either build is fine")
    assert sidecar.build() == expected


def _compiled_modules() -> list[Path]:
    root = Path(__file__).resolve().parents[2]
    listed = re.findall(r'"(sidecar/[^"]+\.py)"', (root / "setup.py").read_text())
    assert listed, "setup.py's COMPILED list was not found"
    return [root / m for m in listed]


def test_no_compiled_function_binds_one_name_to_two_exception_types():
    """mypyc types a local by its first binding: ``except A as exc`` then ``except B as exc``
    in one function makes the second handler raise TypeError ("A object expected; got B")
    under the compiled build, replacing the exception it was meant to handle. (It broke the
    pool-exhausted answer once.) Each handler of another type gets a name of its own."""
    clashes = []
    for path in _compiled_modules():
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            types: dict[str, set[str]] = {}
            for node in ast.walk(fn):
                if isinstance(node, ast.ExceptHandler) and node.name:
                    kind = ast.unparse(node.type) if node.type else "BaseException"
                    types.setdefault(node.name, set()).add(kind)
            clashes += [
                f"{path.name}:{fn.name}: {name} {sorted(kinds)}"
                for name, kinds in types.items()
                if len(kinds) > 1
            ]
    assert clashes == []


# What setup.py does before any C compiler runs: mypyc type-checks the COMPILED list and writes
# the C. A type error it finds fails the compiled build (the image, CI's compiled pass, bench/
# perf.py), though plain ``mypy`` (test_lint) may pass: mypyc checks from other roots, so the
# modules of one import cycle are checked in another order.
_MYPYCIFY = """
import re
from pathlib import Path

from mypyc.build import mypycify

listed = re.findall(r'"(sidecar/[^"]+\\.py)"', Path("setup.py").read_text())
mypycify(listed, opt_level="3", debug_level="0")
"""


@pytest.mark.slow
@pytest.mark.once  # it reads the sources: the same result in either build
def test_the_compiled_build_type_checks_as_mypyc_sees_it(tmp_path):
    """The type check setup.py's compiled build runs, in a copy of the tree (mypyc writes its C
    and a cache where it runs). It once failed on ``checks.size`` (an inferred alias that
    policies.py reads in a class body) after a change elsewhere in the import cycle."""
    pytest.importorskip("mypyc")
    root = Path(__file__).resolve().parents[2]
    shutil.copytree(
        root / "sidecar",
        tmp_path / "sidecar",
        ignore=shutil.ignore_patterns("*.so", "__pycache__"),
    )
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(root / name, tmp_path / name)
    res = subprocess.run(
        [sys.executable, "-c", _MYPYCIFY],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stdout[-4000:] + res.stderr[-4000:]

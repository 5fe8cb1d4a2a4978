"""Two test tiers: plain ``pytest`` is the quick one (pyproject's addopts leave out the tests
marked slow); the README's full command, which .ci/run runs, selects everything."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]
PYTEST = ["python3", "-m", "pytest"]


def readme_full_command() -> list[list[str]]:
    """The README's install-and-test command, as its ``&&``-joined commands."""
    text = (ROOT / "README.md").read_text()
    lines = re.findall(r"^    (python3 -m pip install -e '\.\[test\]'.*)$", text, re.M)
    assert len(lines) == 1, lines
    return [shlex.split(part) for part in lines[0].split(" && ")]


def ci_pytest_runs() -> list[list[str]]:
    """Each pytest invocation in .ci/run, its backslash-continued lines joined, without the
    environment assignments before it."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / ".ci" / "run").read_text())
    runs = []
    for line in text.splitlines():
        if line.lstrip().startswith("#"):
            continue
        for part in line.split("&&"):
            words = [w for w in shlex.split(part) if not re.match(r"^[A-Z_]+=", w)]
            if words[:3] == PYTEST:
                runs.append(words)
    return runs


def marker_expression(args: list[str]) -> str | None:
    """What ``-m`` a ``python3 -m pytest ...`` command leaves in force (the last one wins,
    over addopts too); None where it gives none."""
    found = None
    args = args[len(PYTEST) :]
    for i, arg in enumerate(args):
        if arg == "-m":
            found = args[i + 1]
        elif arg.startswith("-m") and len(arg) > 2:
            found = arg[2:]
    return found


def test_ci_runs_the_readmes_full_command_in_both_passes():
    commands = readme_full_command()
    assert commands[-1][:3] == PYTEST
    ci = re.sub(r"\\\n\s*", " ", (ROOT / ".ci" / "run").read_text())
    for command in commands[:-1]:
        assert shlex.join(command) in ci or " ".join(command) in ci, command
    runs = ci_pytest_runs()
    assert len(runs) == 2, runs  # the pure build, then the compiled one
    wanted = marker_expression(commands[-1])
    assert wanted == ""
    # The compiled pass leaves out only what gives the same result in either build.
    assert [marker_expression(run) for run in runs] == [wanted, "not once"]


def test_the_readmes_full_command_deselects_nothing_and_plain_pytest_leaves_out_slow():
    """Collected (not run) as the README's two commands would: the full one keeps every test,
    the quick one (plain pytest) leaves some out and keeps some."""

    def collect(*args: str) -> str:
        res = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "--collect-only",
                "-q",
                "-p",
                "no:cacheprovider",
                *args,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert res.returncode == 0, res.stdout + res.stderr
        return res.stdout.strip().splitlines()[-1]

    full = collect(*readme_full_command()[-1][3:])
    every = re.fullmatch(r"(\d+) tests collected in .*", full)
    assert every, full
    quick = re.fullmatch(r"(\d+)/(\d+) tests collected \((\d+) deselected\) in .*", collect())
    assert quick, "plain pytest deselects nothing"
    kept, total, deselected = (int(g) for g in quick.groups())
    assert total == int(every.group(1)) and kept > 0 and deselected > 0

"""pip-audit over the pinned runtime dependencies (requirements.lock).

pip-audit needs vulnerability data from PyPI's JSON API or OSV. Where neither answers (this
workplace's package mirror serves no vulnerability data, and OSV is not reachable), the test is
skipped with that reason; wherever the data is reachable, any known vulnerability fails it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# pip-audit: a vulnerability lookup over the network; the same result in either build
pytestmark = [pytest.mark.slow, pytest.mark.once]


def test_no_known_vulnerabilities_in_pinned_dependencies():
    exe = shutil.which("pip-audit", path=str(Path(sys.executable).parent)) or shutil.which(
        "pip-audit"
    )
    assert exe, "pip-audit is a test dependency"
    res = subprocess.run(
        [
            exe,
            "-r",
            str(ROOT / "requirements.lock"),
            "-r",
            str(ROOT / "requirements-otlp.lock"),
            "--no-deps",
            "--disable-pip",
            "--progress-spinner",
            "off",
            "-f",
            "json",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    try:
        report = json.loads(res.stdout)
    except json.JSONDecodeError:
        pytest.skip(f"pip-audit could not reach its vulnerability data: {res.stderr[-300:]}")
    deps = report["dependencies"]
    audited = [d for d in deps if "skip_reason" not in d]
    if not audited:
        pytest.skip(
            "pip-audit could not reach vulnerability data for any dependency "
            f"(first reason: {deps[0]['skip_reason'] if deps else 'none'})"
        )
    vulnerable = {
        d["name"]: [v["id"] for v in d.get("vulns", [])] for d in audited if d.get("vulns")
    }
    assert vulnerable == {}, vulnerable

"""The documentation site (mkdocs.yml, docs/) builds with no warning: ``mkdocs build --strict``
fails on a link to a page or an anchor that does not exist, a page of docs/ the navigation
leaves out, an absolute link, and a README section the home page includes that is not there."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]


def test_the_site_builds_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    res = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "WARNING" not in res.stderr, res.stderr
    home = (site / "index.html").read_text()
    # The home page takes the README's commands and tour (pymdownx.snippets), not a copy.
    assert "python3 -m pip install -e '.[test]'" in home
    assert "x-retry-fate: kill-switch" in home


class Tagless(yaml.SafeLoader):
    """Reads mkdocs.yml's own tags (``!relative``) as the plain values they tag."""


Tagless.add_multi_constructor("!", lambda loader, suffix, node: loader.construct_scalar(node))


def test_the_site_is_strict_about_what_it_checks() -> None:
    """What the strict build fails on is configured, not left to MkDocs' defaults (which only
    inform of a missing anchor or a page out of the nav)."""
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=Tagless)
    validation = config["validation"]
    assert validation["nav"]["omitted_files"] == "warn"
    assert validation["nav"]["not_found"] == "warn"
    assert validation["links"] == {
        "not_found": "warn",
        "absolute_links": "warn",
        "unrecognized_links": "warn",
        "anchors": "warn",
    }
    assert config["theme"]["name"] == "material"

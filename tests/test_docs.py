"""The repository stands on its own: no citation of documents it does not contain, and the
README's pictures and links point at files that exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUTSIDE = ("DESIGN" + ".md", "../" + "shared")  # split, so this file does not cite them


def tracked() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return [ROOT / p for p in out.split("\0") if p]


def test_nothing_cites_documents_outside_the_repository():
    found = []
    for path in tracked():
        if path.suffix in (".png", ".sqlite3") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        found += [f"{path.relative_to(ROOT)}: {w}" for w in OUTSIDE if w in text]
    assert found == []


def test_readme_links_and_images_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(((?!https?:)[^)#]+)\)", text)
    assert "docs/status-page.png" in targets and "docs/architecture.md" in targets
    assert [t for t in targets if not (ROOT / t).exists()] == []
    png = (ROOT / "docs" / "status-page.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 20_000


def test_architecture_names_modules_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for ref in set(re.findall(r"`((?:sidecar/)?[a-z_]+/[a-z_]+\.py)`", text)):
        assert (ROOT / ref).exists() or (ROOT / "sidecar" / ref).exists(), ref
    assert "## Who owns what" in text


def curl_commands(text: str) -> list[str]:
    """Every curl command in a document, its backslash-continued lines joined."""
    joined = re.sub(r"\\\n\s*", " ", text)
    return [m.group(0) for m in re.finditer(r"\bcurl -[^\n`]*", joined)]


def test_curl_examples_that_send_json_say_so():
    """Round 3, finding 05: the README's kill-switch command sent its JSON with ``-d`` alone,
    which curl labels application/x-www-form-urlencoded; the admin API answers that 415."""
    docs = [ROOT / "README.md", ROOT / "helm/retry-sidecar/templates/NOTES.txt"]
    docs += sorted((ROOT / "docs").glob("*.md"))
    sending_json = [
        (path.name, cmd)
        for path in docs
        for cmd in curl_commands(path.read_text())
        if re.search(r"(-d|--data(-raw|-binary)?) +['\"]?[{\[]", cmd)
    ]
    assert len(sending_json) >= 3  # the README's two kill-switch commands and the chart's
    wrong = [
        (name, cmd)
        for name, cmd in sending_json
        if not re.search(r"Content-Type: *application/json|--json ", cmd, re.IGNORECASE)
    ]
    assert wrong == []

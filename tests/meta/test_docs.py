"""The repository stands on its own: no citation of documents it does not contain, and the
README's pictures and links point at files that exist. The documentation pages (docs/) say what
the code does: the outcome vocabulary, the config's defaults, what the example file sets. That
the site builds, every link and anchor included, is tests/meta/test_site.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = ("DESIGN" + ".md", "../" + "shared")  # split, so this file does not cite them
DOCS = ROOT / "docs"


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
    # the kill-switch commands of operating.md and deploying.md, and the chart's
    assert len(sending_json) >= 3
    wrong = [
        (name, cmd)
        for name, cmd in sending_json
        if not re.search(r"Content-Type: *application/json|--json ", cmd, re.IGNORECASE)
    ]
    assert wrong == []


# -- the documented outcome vocabulary is the table's (sidecar/outcomes.py) -----------------


def bullet(page: str, start: str) -> str:
    """The bullet (or table row) of ``docs/<page>`` that begins with ``start``, up to the next
    bullet or blank line (the end of the row)."""
    text = (DOCS / page).read_text()
    i = text.index(start)
    ends = ("\n",) if start.startswith("|") else ("\n- ", "\n\n")
    end = min(j for j in (text.find(e, i) for e in ends) if j != -1)
    return text[i:end].replace("\n", " ")


def test_documented_retry_on_words_are_the_tables():
    from sidecar.config.model import RetryOn
    from sidecar.config.parse import parse_text
    from sidecar.outcomes import GRPC_RETRY_ON, RETRY_ON_WORDS, STATUS_GROUPS

    row = bullet("configuration.md", "| `routes[].retry.retry_on` |")
    m = re.fullmatch(r"\| `routes\[\]\.retry\.retry_on` \| `\[(.*?)\]` \| (.*) \|", row)
    assert m is not None, row
    default, also = m.groups()
    words = [w for w in default.split(", ") if not w.isdigit()]
    documented = set(words) | {w for w in re.findall(r"`([a-z0-9-]+)`", also) if not w.isdigit()}
    assert documented == set(RETRY_ON_WORDS) | set(STATUS_GROUPS) | set(GRPC_RETRY_ON)
    cfg = parse_text(
        f"version: 1\nroutes:\n  - name: r\n    upstream: http://127.0.0.1:1\n"
        f"    retry: {{retry_on: [{default}]}}\n"
    )
    assert cfg.routes[0].retry.retry_on == RetryOn()  # the documented default is the default
    config_default = re.search(r"retry_on: \[(.*?)\]", (ROOT / "config/sidecar.yaml").read_text())
    assert config_default is not None and config_default.group(1) == default


def test_documented_fates_are_the_fates():
    from sidecar.core import Fate
    from sidecar.outcomes import ROWS

    text = bullet("headers.md", "- `x-retry-attempts: N`")
    named = {w for w in re.findall(r"`([a-z][a-z-]*)`", text) if not w.startswith("x-retry")}
    assert {f.value for f in Fate} <= named
    assert named - {f.value for f in Fate} <= {r.code for r in ROWS}


def test_documented_proxy_errors_and_their_statuses_are_the_tables():
    """``x-retry-proxy-error: <code>`` ... `code` / `code` (status: ...), ...: every code the
    sidecar answers with, each with its row's status."""
    from sidecar.outcomes import BAD_REQUEST, ROWS

    text = bullet("headers.md", "- `x-retry-proxy-error: <code>`")
    listed = text[text.index("`connect-failure`") :]
    documented: dict[str, int] = {}
    pending: list[str] = []
    for m in re.finditer(r"\((\d{3})[^)]*\)|`([a-z][a-z-]*)`", listed):
        if m.group(1):
            documented.update((code, int(m.group(1))) for code in pending)
            pending = []
        else:
            pending.append(m.group(2))
    answers = {r.code: r.status for r in ROWS if r.status is not None and r is not BAD_REQUEST}
    assert documented == answers


def test_documented_refusals_are_the_tables():
    from sidecar.outcomes import BAD_REQUEST, REFUSALS

    text = bullet("headers.md", "- Requests refused before routing")
    assert f"`x-retry-proxy-error: {BAD_REQUEST.code}`" in text
    assert {int(s) for s in re.findall(r"\b([45]\d\d)\b", text)} == set(REFUSALS)


def test_documented_proxy_status_errors_are_the_tables():
    from sidecar.outcomes import REFUSALS, ROWS

    text = bullet("headers.md", "- Every response the sidecar made itself also carries")
    named = set(re.findall(r"`([a-z]+(?:_[a-z]+)+)`", text))
    table = {r.proxy_status for r in ROWS if r.proxy_status is not None}
    table |= {p for r in ROWS for p in r.precise} | set(REFUSALS.values())
    assert named == table


def test_documented_attempt_outcomes_are_the_tables():
    from sidecar.core import LocalOverload
    from sidecar.outcomes import CANCELLED, OutcomeKind, label

    text = (DOCS / "observability.md").read_text().replace("\n", " ")
    m = re.search(
        r"`attempts_total\{route,outcome\}` \| counter \| outcome: status code or (.*?) \|", text
    )
    assert m is not None
    named = set(re.findall(r"`([a-z][a-z-]*)`", m.group(1)))
    labels = {label(k) for k in OutcomeKind if k is not OutcomeKind.RESPONSE}
    labels |= {t.answer.code for t in LocalOverload.__subclasses__()} | {CANCELLED.name}
    assert named == labels


def test_what_the_docs_say_of_the_example_file_is_true():
    """Outside finding (issue 29): the README said the example file shows every key with its
    default, but it sets its own name, listen and routes. The keys the example sets are the
    ones the configuration reference's sentence names, and every other top-level key parses to
    its default."""
    from dataclasses import MISSING

    from sidecar.config import schema
    from sidecar.config.model import Config
    from sidecar.config.parse import parse_text
    from sidecar.config.render import set_by_example

    example = parse_text((ROOT / "config/sidecar.yaml").read_text())
    differ = [
        e.name
        for e in schema.entries(Config)
        if e.default is not MISSING and getattr(example, e.attr) != e.default
    ]
    assert differ == set_by_example() == ["name", "listen", "routes"], differ
    text = " ".join((DOCS / "configuration.md").read_text().split())
    said = re.search(r"The example `config/sidecar\.yaml` (.*?)\. ", text)
    assert said is not None
    claim = said.group(1)
    assert "but for" in claim, claim  # not "every key with its default"
    assert re.findall(r"`(\w+)`", claim.split("(")[0]) == set_by_example(), claim


def test_the_metrics_table_lists_every_series_the_code_exports():
    """Outside review: the metrics were one paragraph of ~40 names. observability.md has a
    table with a row per series of the sidecar's own (build_info aside, in the text below it)."""
    from sidecar.telemetry.metrics import Metrics

    exported = {
        line.split()[2].removeprefix("retry_sidecar_")
        for line in Metrics().render().splitlines()
        if line.startswith("# TYPE retry_sidecar_")
    }
    text = (DOCS / "observability.md").read_text()
    rows = re.findall(
        r"^\| `([a-z_]+)(?:\{[a-z,]*\})?` \| (counter|gauge|histogram) \|", text, re.M
    )
    assert len(rows) == len({n for n, _ in rows})
    assert {n for n, _ in rows} == exported - {"build_info"}

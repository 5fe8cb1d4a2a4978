"""MkDocs hook (mkdocs.yml ``hooks:``): a table cell's code span written ``\\|`` shows ``|``.

GitHub's Markdown reads ``\\|`` in a table row as a pipe that does not end the cell, code spans
included, so the pages write ``{scope: global \\| route:<name>}``. Python-Markdown's tables never
split a row inside a code span, and keep a code span's backslash: the site would show ``\\|``.
This removes the backslash inside code spans of table rows before the page is rendered."""

from __future__ import annotations

import re
from typing import Any

_CODE = re.compile(r"`[^`\n]*`")


def _unescape(m: re.Match[str]) -> str:
    return m.group(0).replace("\\|", "|")


def on_page_markdown(markdown: str, **_: Any) -> str:
    lines = markdown.split("\n")
    for i, line in enumerate(lines):
        if line.lstrip().startswith("|"):
            lines[i] = _CODE.sub(_unescape, line)
    return "\n".join(lines)

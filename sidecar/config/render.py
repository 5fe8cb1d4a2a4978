"""What the schema renders: the key table of the configuration reference
(docs/configuration.md), the example file with every default, and a config as ``GET /config``
shows it. ``python3 -m sidecar.config.render`` rewrites the reference's table and
``config/sidecar.yaml``; tests/config/test_config_schema.py fails when either has drifted."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from dataclasses import MISSING
from pathlib import Path
from typing import Any

import yaml

from sidecar.config import schema
from sidecar.config.model import Config, Route
from sidecar.config.units import MAX_SIZE

TABLE_BEGIN = "<!-- config-table:begin -->"
TABLE_END = "<!-- config-table:end -->"
SECTIONS_BEGIN = "<!-- config-sections:begin -->"
SECTIONS_END = "<!-- config-sections:end -->"
HEADER = (
    "# retry-sidecar policy. Edit, then check with: retry-sidecar validate config/sidecar.yaml\n"
    "# Reference: docs/configuration.md. A working example with every key written out: at\n"
    "# its default but for {own}, set for this example (docs/configuration.md's key\n"
    "# table gives every default). Generated from the schema (python3 -m sidecar.config.render).\n"
)
NOTE_COLUMN = 34
_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")
# The page of docs/ (beside configuration.md) that holds each section a key's help text cites as
# see "Section"; the table links them. `mkdocs build --strict` (tests/meta/test_site.py) fails on
# a page or anchor that is not there. A section not listed stays quoted text.
SECTION_PAGES = {
    "Storm control": "retries.md",
    "Dead-letter queue": "dlq.md",
    "Effectively-once writes": "idempotency.md",
    "Fleet mode": "fleet.md",
    "Operating it": "operating.md",
    "In an incident": "incidents.md",
    "Upgrades (WebSocket)": "headers.md#upgrades-websocket",
    "TLS": "tls.md",
}
_CITED = re.compile(r'\b([Ss]ee) "([^"]+)"')


def _duration(seconds: float) -> str:
    for unit, size in (("h", 3600), ("s", 1)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds / size:g}{unit}"
    return f"{seconds * 1000:g}ms"


def _size(n: int) -> str:
    if n == MAX_SIZE:
        return "unlimited"
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def written(value: Any, key: schema.Key | None = None) -> str:
    """``value`` as the config file writes it (YAML flow style)."""
    if key is not None and key.show is not None:
        value = key.show(value)
    unit = key.unit if key is not None else ""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if unit == "duration" and isinstance(value, int | float):
        return _duration(value)
    if unit == "size" and isinstance(value, int):
        return _size(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, frozenset | set):
        return "[" + ", ".join(written(v) for v in sorted(value)) + "]"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(written(v) for v in value) + "]"
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _of(value):
        return _flow(value)
    text = str(value)
    if _PLAIN.fullmatch(text) and yaml.safe_load(text) == text:
        return text
    return json.dumps(text)


def setting(section: object, attr: str) -> str:
    """``section``'s key ``attr`` as the config file writes it, by the schema's unit (a duration
    as ``60s``, a size as ``64KiB``): what ``retry-sidecar explain`` prints for a setting."""
    for e in schema.entries(type(section)):
        if e.attr == attr:
            return written(getattr(section, attr), e.key)
    raise KeyError(f"{type(section).__name__} declares no key {attr!r}")


def _flow(value: object) -> str:
    parts = [f"{e.name}: {written(getattr(value, e.attr), e.key)}" for e in _of(value)]
    return "{" + ", ".join(parts) + "}"


def _of(value: object) -> list[schema.Entry]:
    return list(schema.entries(type(value)))


# -- the example file -----------------------------------------------------------------------


def _line(text: str, note: str) -> str:
    if not note:
        return text
    return f"{text.ljust(NOTE_COLUMN - 2)}  # {note}"


def _entry_lines(e: schema.Entry, value: Any, indent: int) -> list[str]:
    pad = " " * indent
    above, _, trailing = e.key.note.rpartition("\n")
    lines = [f"{pad}# {line}" for line in above.split("\n") if line] if above else []
    if e.section is not None and not e.key.flow:
        lines.append(_line(f"{pad}{e.name}:", trailing))
        for sub in _of(value):
            lines.extend(_entry_lines(sub, getattr(value, sub.attr), indent + 2))
        return lines
    first, _, rest = (e.key.example or written(value, e.key)).partition("\n")
    lines.append(_line(f"{pad}{e.name}: {first}".rstrip(), trailing))
    if rest:
        lines.extend(rest.split("\n"))
    return lines


def set_by_example() -> list[str]:
    """The top-level keys the example file sets to a value of its own, not their default
    (a required key with no default is not one)."""
    own = []
    for e in schema.entries(Config):
        if not e.key.example or e.default is MISSING:
            continue
        if yaml.safe_load(e.key.example) != yaml.safe_load(written(e.default, e.key)):
            own.append(e.name)
    return own


def example_file() -> str:
    """``config/sidecar.yaml``: every key written out, commented from the schema; at its
    default but for the keys ``set_by_example``."""
    names = [f"`{name}`" for name in set_by_example()]
    own = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
    lines = [HEADER.format(own=own).rstrip("\n")]
    for e in schema.entries(Config):
        if e.attr == "routes":
            lines.append("defaults:")
            for r in schema.entries(Route):
                if r.default is not MISSING:
                    lines.extend(_entry_lines(r, r.default, 2))
        lines.extend(_entry_lines(e, e.default, 0))
    return "\n".join(lines) + "\n"


# -- the configuration reference's table ---------------------------------------------------


def _linked(help_text: str) -> str:
    """``help_text`` with each ``see "Section"`` it cites made a link to the page holding it."""

    def link(m: re.Match[str]) -> str:
        page = SECTION_PAGES.get(m.group(2))
        return f"{m.group(1)} [{m.group(2)}]({page})" if page else m.group(0)

    return _CITED.sub(link, help_text)


def anchor(label: str) -> str:
    """The id of a key's row in the reference: its path without ``[]``
    (``routes[].retry.attempts`` -> ``routes.retry.attempts``), so a page links
    ``configuration.md#routes.retry.attempts``."""
    return label.replace("[]", "")


def _rows(cls: type, prefix: str) -> list[tuple[str, str]]:
    """(key path, table row) for each key ``cls`` declares, sections with rows of their own
    flattened."""
    out = []
    for e in schema.entries(cls):
        label = prefix + e.name
        if e.section is not None and e.key.rows:
            out.extend(_rows(e.section, label + "."))
            continue
        if e.key.default_doc:
            default = e.key.default_doc
        elif e.key.required:
            default = "required"
        else:
            default = f"`{written(e.default, e.key)}`"
        if not e.key.help:
            raise ValueError(f"{label}: a key the reference lists needs help text")
        # The id opens the meaning cell: the key cell stays the key alone.
        cell = f'<a id="{anchor(label)}"></a>{_linked(e.key.help)}'
        out.append((label, f"| `{label}` | {default} | {cell} |"))
        if e.attr == "routes":
            out.extend(_rows(Route, "routes[]."))
    return out


def _sections(labels: list[str]) -> str:
    """The sections of the table, each a link to its first row: the top-level ones, then a
    route's."""
    top: dict[str, str] = {}
    route: dict[str, str] = {}
    for label in labels:
        if label.startswith("routes[]."):
            route.setdefault(label.split(".")[1], label)
        else:
            top.setdefault(label.split(".")[0], label)

    def links(sections: dict[str, str]) -> str:
        return ", ".join(f"[`{name}`](#{anchor(first)})" for name, first in sections.items())

    return (
        f"- Top level: {links(top)}\n"
        f"- Each route (`routes[]`; all but `name`, `match` and `upstream` also in `defaults`): "
        f"{links(route)}"
    )


def key_table() -> str:
    """The table: a row per key, each with the id ``anchor`` gives it."""
    rows = [row for _, row in _rows(Config, "")]
    return "\n".join(["| key | default | meaning |", "|---|---|---|", *rows])


def _between(page: str, begin: str, end: str, text: str) -> str:
    head, found, rest = page.partition(begin)
    _, found_end, tail = rest.partition(end)
    if not found or not found_end:
        raise ValueError(f"the configuration reference has no {begin} ... {end} markers")
    return f"{head}{begin}\n{text}\n{end}{tail}"


def with_table(page: str) -> str:
    """``page`` with the text between the sections' markers replaced by the list of sections,
    and between the table's by ``key_table()``."""
    page = _between(
        page, SECTIONS_BEGIN, SECTIONS_END, _sections([k for k, _ in _rows(Config, "")])
    )
    return _between(page, TABLE_BEGIN, TABLE_END, key_table())


# -- GET /config ----------------------------------------------------------------------------


def as_json(value: Any, key: schema.Key | None = None) -> Any:
    """A config value as JSON: a section as an object of every key it declares; durations in
    seconds, sizes in bytes, ``None`` (auto, unset) as null."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and _of(value):
        return {e.name: as_json(getattr(value, e.attr), e.key) for e in _of(value)}
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if key is not None and key.show is not None:
        return as_json(key.show(value))
    if isinstance(value, frozenset | set):
        return sorted(as_json(v) for v in value)
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): as_json(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: as_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return str(value)


def settings_json(config: Config) -> dict[str, Any]:
    """Every top-level key but the routes (which ``GET /config`` lists one by one)."""
    return {
        e.name: as_json(getattr(config, e.attr), e.key) for e in _of(config) if e.attr != "routes"
    }


def main(root: str = ".") -> None:
    base = Path(root)
    reference = base / "docs" / "configuration.md"
    reference.write_text(with_table(reference.read_text()))
    (base / "config" / "sidecar.yaml").write_text(example_file())


if __name__ == "__main__":
    main(*sys.argv[1:])

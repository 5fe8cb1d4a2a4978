"""The config's schema: every key is declared once, as the metadata of the dataclass field that
holds it (``key(...)`` for a value, ``section(...)`` for a nested section), next to its default.

Everything else is derived from these declarations by walking the dataclasses: the parser
(``parse``), the defaults a route inherits, the reload classification (``reload_rules``), the
key table of docs/configuration.md and the example file (``render``), ``GET /config``
(``render.as_json``).
Adding a section is declaring its dataclass (fields made with ``key``) and one ``section(...)``
field where it belongs: on ``Route`` for a per-route section, on ``Config`` for a top-level one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator
from dataclasses import MISSING, dataclass
from typing import Any, Literal

Unit = Literal["", "duration", "size"]
Check = Callable[[object], Any]
# A rule across the keys of one section: (the section's value, the keys written) -> the value
# to keep and the problems found, as (key, message).
Rule = Callable[[Any, Collection[str]], tuple[Any, list[tuple[str, str]]]]

_META = "sidecar.config.schema"
_RULES: dict[type, Rule] = {}


@dataclass(frozen=True, slots=True)
class Key:
    """What the schema knows of one key besides its name (the field's) and default."""

    check: Check | None  # None: a section, whose keys are the fields of its dataclass
    help: str = ""  # the meaning of the key in docs/configuration.md
    note: str = ""  # the example file's comment (a line break: comment lines above the key)
    unit: Unit = ""
    live: bool | None = None  # applied by a reload (False: restart-only); None: as its parent
    yaml: str = ""  # the name in the file, when it is not the attribute's
    required: str = ""  # the message when it is missing ("": optional)
    default_doc: str = ""  # the reference's default when the value says it badly (hostname)
    example: str = ""  # the example file's text for it, instead of the default
    flow: bool = False  # a section written on one line: {a: 1, b: 2}
    rows: bool = False  # a section the reference lists key by key instead of in one row
    own: bool = False  # parsed by its own code in parse.py (routes, match, killswitches)
    show: Callable[[Any], object] | None = None  # the value as a config writes it


@dataclass(frozen=True, slots=True)
class Entry:
    """One declared field of a section."""

    attr: str  # the attribute the code reads
    name: str  # the key in the file
    key: Key
    default: Any  # MISSING when required
    section: type | None  # the nested dataclass of a section


def key(
    default: Any = MISSING,
    check: Check | None = None,
    *,
    factory: Callable[[], Any] | None = None,
    **spec: Any,
) -> Any:
    """A key: its default (or ``factory``), its check, and what ``Key`` says of it."""
    meta = {_META: Key(check=check, **spec)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls: type, **spec: Any) -> Any:
    """A nested section, whose default is its dataclass with every default."""
    return dataclasses.field(default_factory=cls, metadata={_META: Key(check=None, **spec)})


def rule(cls: type) -> Callable[[Rule], Rule]:
    """Declare the rule across ``cls``'s keys that the parser applies after them."""

    def register(fn: Rule) -> Rule:
        _RULES[cls] = fn
        return fn

    return register


def rule_of(cls: type) -> Rule | None:
    return _RULES.get(cls)


def entries(cls: type) -> Iterator[Entry]:
    """The declared fields of a section, in declaration order."""
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_META)
        if not isinstance(spec, Key):
            continue
        default: Any = f.default
        sub: type | None = None
        if f.default_factory is not MISSING:
            factory = f.default_factory
            if spec.check is None and isinstance(factory, type):
                sub = factory
            default = factory()
        yield Entry(f.name, spec.yaml or f.name, spec, default, sub)


def names(cls: type) -> tuple[str, ...]:
    return tuple(e.name for e in entries(cls))


def defaults(cls: type) -> dict[str, Any]:
    """The defaults of ``cls``'s optional keys, by attribute (a route's, before ``defaults``)."""
    return {e.attr: e.default for e in entries(cls) if e.default is not MISSING}


def reload_rules(cls: type, prefix: str = "", inherited: bool = True) -> dict[str, str]:
    """Every key by attribute path: "live" or "restart". A section declared live or
    restart-only is classified as a whole; any other is classified key by key."""
    out: dict[str, str] = {}
    for e in entries(cls):
        live = inherited if e.key.live is None else e.key.live
        if e.section is not None and e.key.live is None:
            out.update(reload_rules(e.section, f"{prefix}{e.attr}.", live))
        else:
            out[prefix + e.attr] = "live" if live else "restart"
    return out


def leaves(cls: type, prefix: str = "") -> Iterator[tuple[str, Entry]]:
    """Every key that holds a value (sections walked into), with its path of file names."""
    for e in entries(cls):
        if e.section is not None:
            yield from leaves(e.section, f"{prefix}{e.name}.")
        else:
            yield prefix + e.name, e

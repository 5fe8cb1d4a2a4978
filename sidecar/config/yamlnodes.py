"""Load YAML into plain Python values while remembering the line of every key path.

Errors must name the key path and its line (``routes[2].retry.attempts``), so the parser works on
PyYAML's node graph rather than on ``safe_load`` output. Aliases are expanded with a node budget,
so an alias bomb ("billion laughs") is refused instead of eating memory; nesting is bounded (the
composer recurses per level, and a RecursionError is not a YAML error); a scalar its resolver
cannot build (a 5,000-digit integer, a 13th month) is an error at its key, not an exception.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import yaml

MAX_DOCUMENT_BYTES = 1024 * 1024
MAX_NODES = 100_000
MAX_DEPTH = 32  # the deepest key of a valid config is 5 levels down
MAX_NUMBER_CHARS = 64  # int() of a longer digit string costs, then fails past 4,300 digits
_NUMBER_TAGS = ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")
# One loader instance, used only to turn scalar nodes into Python values with the safe resolver.
_SCALARS = yaml.SafeLoader("")

Path = tuple[str | int, ...]


def path_str(path: Path) -> str:
    out = ""
    for part in path:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + part
    return out or "<root>"


class YamlLoadError(ValueError):
    def __init__(self, line: int, message: str, path: str = "<document>") -> None:
        super().__init__(message)
        self.line = line
        self.message = message
        self.path = path


@dataclass
class Located:
    """Plain data plus a map from key path to 1-based line number."""

    data: object
    lines: dict[Path, int] = field(default_factory=dict)

    def line(self, path: Path) -> int:
        """The line of ``path`` or of its nearest ancestor that has one."""
        p = path
        while p:
            if p in self.lines:
                return self.lines[p]
            p = p[:-1]
        return self.lines.get((), 1)


def load(text: str) -> Located:
    if len(text.encode("utf-8", "surrogatepass")) > MAX_DOCUMENT_BYTES:
        raise YamlLoadError(1, f"the document is larger than {MAX_DOCUMENT_BYTES} bytes")
    loader: yaml.SafeLoader | None = None
    try:
        loader = yaml.SafeLoader(text)  # its reader checks the characters here already
        node = loader.get_single_node()
    except RecursionError:
        line = loader.get_mark().line + 1 if loader is not None else 1
        raise YamlLoadError(line, f"the document nests deeper than {MAX_DEPTH} levels") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        raise YamlLoadError(line, f"invalid YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise YamlLoadError(1, f"invalid YAML: {exc}") from None
    finally:
        if loader is not None:
            loader.dispose()
    located = Located(data=None)
    if node is None:
        return located
    budget = [MAX_NODES]
    located.data = _convert(node, (), located.lines, budget)
    return located


def _convert(node: yaml.Node, path: Path, lines: dict[Path, int], budget: list[int]) -> object:
    budget[0] -= 1
    if budget[0] < 0:
        raise YamlLoadError(
            node.start_mark.line + 1,
            f"the document expands to more than {MAX_NODES} nodes (alias bomb?)",
        )
    if len(path) > MAX_DEPTH:
        raise YamlLoadError(
            node.start_mark.line + 1, f"the document nests deeper than {MAX_DEPTH} levels"
        )
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        out: dict[str, object] = {}
        for key_node, value_node in node.value:
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlLoadError(key_node.start_mark.line + 1, "mapping keys must be scalars")
            key = str(key_node.value)
            if key == "<<":
                raise YamlLoadError(
                    key_node.start_mark.line + 1, "merge keys ('<<') are not supported"
                )
            child = (*path, key)
            if key in out:
                raise YamlLoadError(
                    key_node.start_mark.line + 1, f"{path_str(child)}: duplicate key"
                )
            lines[child] = key_node.start_mark.line + 1
            out[key] = _convert(value_node, child, lines, budget)
        return out
    if isinstance(node, yaml.SequenceNode):
        return [_convert(item, (*path, i), lines, budget) for i, item in enumerate(node.value)]
    assert isinstance(node, yaml.ScalarNode)
    if node.tag in _NUMBER_TAGS and len(node.value) > MAX_NUMBER_CHARS:
        raise YamlLoadError(
            node.start_mark.line + 1,
            f"a number of more than {MAX_NUMBER_CHARS} characters",
            path_str(path),
        )
    try:
        return _SCALARS.construct_object(node)
    except (yaml.YAMLError, ValueError, OverflowError) as exc:  # ValueError: a bad date
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise YamlLoadError(
            node.start_mark.line + 1, f"unsupported value: {problem}", path_str(path)
        ) from None

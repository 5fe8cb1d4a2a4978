"""No function under sidecar/ takes more than six positional parameters (one source for every
name: past six, a call site passes the rest by name, as stamina's API does).

Read with the ast module. Positional-only and positional-or-keyword parameters count; the first
parameter of a method (``self``, ``cls``) does not, nor do ``*args``, keyword-only parameters and
``**kwargs``. A function nested in a method is a plain function; a ``@staticmethod`` has no
``self``.
"""

from __future__ import annotations

import ast
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = ROOT / "sidecar"

MAX_POSITIONAL = 6

# "path/to/file.py:Qualified.name" -> why it is left out of the rule. Empty: every function
# keeps the rule.
ALLOWED: dict[str, str] = {}


@dataclass(frozen=True)
class Signature:
    where: str  # file:line of the def
    name: str  # qualified: Class.method, outer.inner
    positional: int  # counted as the rule counts


FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def _is_method(node: FunctionNode, parent: ast.AST) -> bool:
    if not isinstance(parent, ast.ClassDef):
        return False
    return not any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in node.decorator_list)


def positional_count(node: FunctionNode, *, method: bool) -> int:
    count = len(node.args.posonlyargs) + len(node.args.args)
    return count - 1 if method and count else count


def signatures(tree: ast.AST, rel: str) -> Iterator[Signature]:
    def walk(parent: ast.AST, prefix: str) -> Iterator[Signature]:
        for child in ast.iter_child_nodes(parent):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = prefix + child.name
                method = _is_method(child, parent)
                yield Signature(
                    f"{rel}:{child.lineno}", name, positional_count(child, method=method)
                )
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, prefix + child.name + ".")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def all_signatures() -> list[Signature]:
    found: list[Signature] = []
    for path in sorted(SIDECAR.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        found.extend(signatures(ast.parse(path.read_text(), filename=rel), rel))
    return found


def _key(sig: Signature) -> str:
    return f"{sig.where.split(':')[0]}:{sig.name}"


def test_no_function_takes_more_than_six_positional_parameters() -> None:
    over = [
        f"{s.where} {s.name}: {s.positional} positional parameters"
        for s in all_signatures()
        if s.positional > MAX_POSITIONAL and _key(s) not in ALLOWED
    ]
    assert not over, (
        f"more than {MAX_POSITIONAL} positional parameters (make the rest keyword-only, after `*,`):\n"
        + "\n".join(over)
    )


def test_every_allowed_entry_names_a_function_that_still_needs_it() -> None:
    needed = {_key(s) for s in all_signatures() if s.positional > MAX_POSITIONAL}
    stale = sorted(set(ALLOWED) - needed)
    assert not stale, f"allow-list entries no longer needed: {stale}"


def test_the_count_follows_the_rule() -> None:
    source = textwrap.dedent(
        """
        def plain(a, b, /, c, d=1, *args, e, f=2, **kw): ...
        async def coro(a, b, c, d, e, f, g): ...
        class K:
            def method(self, a, b, c, d, e, f): ...
            @classmethod
            def build(cls, a, b, c, d, e, f, g): ...
            @staticmethod
            def helper(a, b, c, d, e, f, g): ...
            def outer(self):
                def inner(a, b): ...
        """
    )
    got = {s.name: s.positional for s in signatures(ast.parse(source), "x.py")}
    assert got == {
        "plain": 4,
        "coro": 7,
        "K.method": 6,
        "K.build": 7,
        "K.helper": 7,
        "K.outer": 0,
        "K.outer.inner": 2,
    }

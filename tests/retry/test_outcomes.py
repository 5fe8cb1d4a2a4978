"""The outcome table (sidecar/outcomes.py) is the one source of every failure kind and every
answer the sidecar makes: complete, read by its users, and no name spelt again elsewhere."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from sidecar import core, outcomes
from sidecar.config.model import RetryOn, RetryPolicy
from sidecar.config.parse import parse_text
from sidecar.core import Fate, LocalOverload, UpstreamError, Verdict
from sidecar.outcomes import ROWS, Effect, OutcomeKind, OutcomeRow
from sidecar.proxy.respond import client_error, own_answer, refusal
from sidecar.retry.classify import Outcome, is_retryable, verdict

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = ROOT / "sidecar"


def error_types() -> list[type[UpstreamError] | type[LocalOverload]]:
    """Every error type of core: what the upstream client, the pool, the bulkhead, the
    concurrency limit and the driver raise or hand to the proxy."""
    found: list[type[UpstreamError] | type[LocalOverload]] = []
    for value in vars(core).values():
        if isinstance(value, type) and issubclass(value, (UpstreamError, LocalOverload)):
            found.append(value)
    return found


def test_every_failure_kind_has_one_row():
    for kind in OutcomeKind:
        rows = [r for r in ROWS if r.kind is kind]
        assert len(rows) == (0 if kind is OutcomeKind.RESPONSE else 1), kind


def test_names_and_codes_are_each_written_once():
    names = [r.name for r in ROWS]
    codes = [r.code for r in ROWS]
    assert len(set(names)) == len(names) and len(set(codes)) == len(codes)


def test_every_error_type_names_a_row_that_agrees_with_it():
    types = error_types()
    assert len(types) >= 10  # the scan found them
    for t in types:
        row = t.answer
        assert row in ROWS, t
        if issubclass(t, UpstreamError) and row.kind is not None:
            assert row.kind is t.kind, t
        if row.breaker is Effect.FAILURE and row.kind is not None:
            assert row.status is not None, t


def test_every_attempt_label_has_a_row():
    """What attempts_total{outcome} and the attempt events can carry: a status, the label of a
    failure kind, the code of a local refusal, or cancelled."""
    labels = {outcomes.label(k) for k in OutcomeKind if k is not OutcomeKind.RESPONSE}
    labels |= {t.answer.code for t in error_types() if issubclass(t, LocalOverload)}
    labels.add(outcomes.CANCELLED.name)
    assert labels <= {r.name for r in ROWS}
    assert outcomes.CANCELLED.status is None  # a label, never an answer


@pytest.mark.parametrize("row", [r for r in ROWS if r.status is not None], ids=lambda r: r.name)
def test_each_answer_is_made_from_its_row(row: OutcomeRow):
    if row is outcomes.BAD_REQUEST:
        for status, error in outcomes.REFUSALS.items():
            resp = client_error(status, "refused")
            made = refusal(status, "refused")
            assert resp.status == made.status == status
            assert resp.headers["x-retry-proxy-error"] == made.header("x-retry-proxy-error")
            assert made.header("x-retry-proxy-error") == row.code
            assert resp.headers["Proxy-Status"] == f"retry-sidecar; error={error}"
            assert made.header("Proxy-Status") == f"retry-sidecar; error={error}"
        return
    own = own_answer(row, Fate.EXHAUSTED, 2)
    assert own.status == row.status
    assert own.header("x-retry-proxy-error") == row.code
    assert own.header("Proxy-Status") == f"retry-sidecar; error={row.proxy_status}"
    assert own.header("x-retry-fate") == "exhausted"
    assert json.loads(own.body) == {"error": row.message, "fate": "exhausted", "attempts": 2}


def test_a_precise_error_type_replaces_the_rows():
    own = own_answer(outcomes.CONNECT_FAILURE, Fate.EXHAUSTED, 3, "connection_refused")
    assert own.header("Proxy-Status") == "retry-sidecar; error=connection_refused"
    assert "connection_refused" in outcomes.CONNECT_FAILURE.precise


def test_retry_on_words_are_the_rows_that_say_so():
    words = {r.name: r.kind for r in ROWS if r.retry_on and r.kind is not None}
    assert words == outcomes.RETRY_ON_WORDS
    for word, kind in words.items():
        cfg = parse_text(
            "version: 1\nroutes:\n  - name: r\n    upstream: http://127.0.0.1:1\n"
            f"    retry: {{retry_on: [{word}]}}\n"
        )
        on = cfg.routes[0].retry.retry_on
        assert on == RetryOn(kinds=frozenset({kind}), statuses=frozenset(), grpc=frozenset())
        assert is_retryable(RetryPolicy(retry_on=on), Outcome(kind))
    # the default: the rows marked so, and the gateway errors
    assert RetryOn().kinds == {r.kind for r in ROWS if r.default}
    assert RetryOn().statuses == set(outcomes.STATUS_GROUPS["gateway-error"])


def test_a_kind_that_is_no_retry_on_word_is_never_retried():
    """bad-response is a property of the answer: no word lists it, so no policy retries it."""
    for row in ROWS:
        if row.kind is not None and not row.retry_on:
            assert row.kind not in outcomes.RETRY_ON_WORDS.values()
            assert not is_retryable(RetryPolicy(), Outcome(row.kind)), row.name
    assert not outcomes.BAD_RESPONSE.retry_on


def test_unknown_word_names_the_table_words():
    with pytest.raises(Exception) as e:
        parse_text(
            "version: 1\nroutes:\n  - name: r\n    upstream: http://127.0.0.1:1\n"
            "    retry: {retry_on: [sometimes]}\n"
        )
    message = str(e.value)
    for word in [*outcomes.RETRY_ON_WORDS, *outcomes.STATUS_GROUPS]:
        assert word in message


@pytest.mark.parametrize("t", error_types(), ids=lambda t: t.__name__)
def test_the_breaker_verdict_of_an_error_is_its_rows(t: type[UpstreamError] | type[LocalOverload]):
    """A sequence that ends on this error, with no earlier failed attempt: the breaker hears
    what the row says (not counted = neutral)."""
    err = t("x")
    v = verdict(RetryPolicy(), None, err, failed_before=False, fate=Fate.EXHAUSTED)
    want = {Effect.FAILURE: Verdict.FAILURE, Effect.NOT_COUNTED: Verdict.NEUTRAL}
    assert v is want[t.answer.breaker], t


# -- no name of the table spelt again in the code ----------------------------------------------

# String constants that equal a row's name or code and are not one: the fates of core.Fate
# (a fate and an answer may share a word), slot names, and the tunnel's own end reasons.
NOT_A_ROW = {
    ("sidecar/core.py", "Fate"),
    ("sidecar/engine/loop.py", "Driver"),  # its __slots__
    ("sidecar/proxy/context.py", "RequestContext"),  # its __slots__ (the request's deadline)
    ("sidecar/proxy/tunnel.py", "RESET"),
}


def _strings(tree: ast.AST) -> list[tuple[str, str, int]]:
    """(owner, text, line) of every string constant that is not a docstring; owner: the class
    or the assigned name it stands in."""
    found: list[tuple[str, str, int]] = []
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = owner
            if isinstance(child, ast.ClassDef):
                name = child.name
            elif (
                not owner
                and isinstance(child, ast.Assign)
                and isinstance(child.targets[0], ast.Name)
            ):
                name = child.targets[0].id
            if (
                isinstance(child, ast.Constant)
                and isinstance(child.value, str)
                and id(child) not in docstrings
            ):
                found.append((owner, child.value, child.lineno))
            visit(child, name)

    visit(tree, "")
    return found


def test_no_row_name_or_code_is_spelt_outside_the_table():
    words = {r.name for r in ROWS} | {r.code for r in ROWS} | set(outcomes.STATUS_GROUPS)
    spelt = []
    for path in sorted(SIDECAR.rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel == "sidecar/outcomes.py":
            continue
        for owner, text, line in _strings(ast.parse(path.read_text())):
            if text in words and (rel, owner) not in NOT_A_ROW:
                spelt.append(f"{rel}:{line}: {text!r} (in {owner or 'module'})")
    assert spelt == []


def test_every_proxy_status_error_the_code_gives_is_in_the_table():
    """The detecting code (core, the upstream client) may name a more precise RFC 9209 error
    type than a row's; each must be listed in a row."""
    known = {r.proxy_status for r in ROWS} | {p for r in ROWS for p in r.precise}
    pattern = re.compile(r"^(http|connection|dns|destination|tls)_[a-z_]+$")
    given = set()
    for path in [SIDECAR / "core.py", *sorted((SIDECAR / "upstream").glob("*.py"))]:
        for _, text, _ in _strings(ast.parse(path.read_text())):
            if pattern.match(text):
                given.add(text)
    assert {"connection_refused", "http_upgrade_failed"} <= given  # the scan finds them
    assert given <= known


def test_answers_in_the_proxy_come_from_rows():
    """Every own_answer call names a row (or a row variable); every literal refusal status
    is one of REFUSALS; nothing else builds a SidecarResponse with a status of its own."""
    bad = []
    for path in sorted((SIDECAR / "proxy").glob("*.py")):
        rel = str(path.relative_to(ROOT))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                continue
            fn, args = node.func.id, node.args
            if fn == "own_answer":
                first = args[0]
                ok = isinstance(first, ast.Name) or (
                    isinstance(first, ast.Attribute)
                    and isinstance(first.value, ast.Name)
                    and first.value.id == "outcomes"
                    and isinstance(getattr(outcomes, first.attr, None), OutcomeRow)
                )
                if not ok:
                    bad.append(f"{rel}:{node.lineno}: own_answer without a row")
            elif fn in ("client_error", "refusal") and args and isinstance(args[0], ast.Constant):
                if args[0].value not in outcomes.REFUSALS:
                    bad.append(f"{rel}:{node.lineno}: refusal {args[0].value!r} not in REFUSALS")
            elif fn == "proxy_error":
                bad.append(f"{rel}:{node.lineno}: proxy_error spells its status and code")
    assert bad == []

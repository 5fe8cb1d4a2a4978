"""The schema is the one source of every key: the configuration reference's table
(docs/configuration.md) and the example file are
rendered from it (drift fails here), ``GET /config`` shows every key, and a reload that changes
every per-route key reaches each key's owner in the running sidecar."""

from __future__ import annotations

from dataclasses import MISSING
from pathlib import Path
from typing import Any

import yaml

from sidecar.config import render, schema
from sidecar.config.model import Config, RetryOn, Route
from sidecar.config.parse import parse_text
from sidecar.outcomes import OutcomeKind
from tests import tlscerts

ROOT = Path(__file__).resolve().parents[2]


def test_the_references_key_table_is_the_schema_rendered() -> None:
    reference = (ROOT / "docs" / "configuration.md").read_text()
    assert reference == render.with_table(reference), "run: python3 -m sidecar.config.render"


def test_example_file_is_the_schema_rendered_with_every_default() -> None:
    text = (ROOT / "config" / "sidecar.yaml").read_text()
    assert text == render.example_file(), "run: python3 -m sidecar.config.render"
    config = parse_text(text)
    plain = config.route("default")
    assert plain is not None
    for attr, default in schema.defaults(Route).items():
        assert getattr(plain, attr) == default, attr


# Values of a kind the generic candidates below do not cover.
SPECIAL: dict[type, list[Any]] = {
    RetryOn: [RetryOn(kinds=frozenset({OutcomeKind.RESET}), statuses=frozenset({503}))]
}


def _candidates(default: Any) -> list[Any]:
    if isinstance(default, bool):
        return [not default]
    if default is None:
        return [2.0, "x-tenant"]
    if isinstance(default, int | float):
        return [default * 2, default / 2, default + 1]
    if isinstance(default, frozenset):
        return [frozenset({"GET"}), frozenset({"x-secret"})]
    return SPECIAL.get(type(default), [])


def changed(e: schema.Entry) -> tuple[str, Any]:
    """Another valid value of the key: as the file writes it, and as the parser reads it."""
    options = getattr(e.key.check, "options", None)
    candidates = list(options) if options else _candidates(e.default)
    assert e.key.check is not None
    for value in candidates:
        text = render.written(value, e.key)
        try:
            parsed = e.key.check(yaml.safe_load(text))
        except ValueError:
            continue
        except Exception as exc:
            if type(exc).__name__ != "Invalid":
                raise
            continue
        if parsed != e.default:
            return text, parsed
    raise AssertionError(f"no other valid value found for {e.name}: extend _candidates")


def per_route_keys() -> dict[str, tuple[str, Any]]:
    out = {}
    for path, e in schema.leaves(Route):
        if e.default is not MISSING:
            out[path] = changed(e)
    return out


def as_yaml(keys: dict[str, tuple[str, Any]]) -> str:
    tree: dict[str, Any] = {}
    for path, (text, _) in keys.items():
        *parents, last = path.split(".")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = text

    def flow(node: Any) -> str:
        if isinstance(node, str):
            return node
        return "{" + ", ".join(f"{k}: {flow(v)}" for k, v in node.items()) + "}"

    return "\n".join(f"    {k}: {flow(v)}" for k, v in tree.items())


def doc(up: str, route_keys: str = "", dlq: str = "") -> str:
    """A config whose DLQ, should a route turn it on, lives in ``dlq`` (a test's directory)."""
    return f"""version: 1
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0"}}
dlq: {{path: "{dlq or "/nonexistent/dlq.sqlite3"}"}}
routes:
  - name: main
    upstream: "{up}"
{route_keys}
"""


def value_at(obj: object, path: str) -> Any:
    for part in path.split("."):
        part = "upstreams" if part == "upstream" else part
        obj = getattr(obj, part)
    return obj


# Who holds each per-route section in the running sidecar besides the config snapshot that
# every request reads (``store.current``): the route's state objects, handed the new policy by
# RouteStates.sync. Each of their policies must hold every key of the section it has.
OWNERS = {
    "breaker": lambda st: [st.breaker.policy],
    "budget": lambda st: [st.budget.policy],
    "throttle": lambda st: [st.throttle.policy],
    "bulkhead": lambda st: [st.bulkhead.policy, st.limiter.policy],
    "hedge": lambda st: [st.hedge_budget.policy],
}


async def test_a_reload_changing_every_per_route_key_reaches_each_owner(
    upstream_factory, sidecar_factory, tmp_path: Path
) -> None:
    from aiohttp import web

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    up = await upstream_factory(ok)
    cfg = tmp_path / "sidecar.yaml"
    dlq = str(tmp_path / "dlq.sqlite3")
    cfg.write_text(doc(up.url, dlq=dlq))
    sc = await sidecar_factory(cfg.read_text(), config_path=str(cfg))
    keys = per_route_keys()
    assert len(keys) >= 50  # every key of every section, walked from the schema
    made = tlscerts.make(tmp_path / "tls")  # the TLS files are read at parse: real ones
    for path, file in (
        ("tls.ca_file", made.ca),
        ("tls.client_cert", made.client.cert),
        ("tls.client_key", made.client.key),
    ):
        keys[path] = (f'"{file}"', file)
    cfg.write_text(doc(up.url, as_yaml(keys), dlq))
    result = await sc.sidecar.reload("test")
    assert result is not None and result.ok and result.changed, result
    route = sc.sidecar.store.current.route("main")
    state = sc.sidecar.states.get("main")
    for path, (_, expected) in keys.items():
        assert value_at(route, path) == expected, path
        section, _, rest = path.partition(".")
        if section not in OWNERS or "." in rest:
            continue
        held = [p for p in OWNERS[section](state) if hasattr(p, rest)]
        assert all(getattr(p, rest) == expected for p in held), (path, held)


async def test_get_config_shows_every_key_and_no_secret(
    upstream_factory, sidecar_factory, client, monkeypatch
) -> None:
    from aiohttp import web

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    monkeypatch.setenv("RETRY_SIDECAR_ADMIN_TOKEN", "s3cret-token-value")
    up = await upstream_factory(ok)
    sc = await sidecar_factory(doc(up.url))
    url = f"http://127.0.0.1:{sc.sidecar.admin_port}/config"
    async with client.get(url, headers={"Authorization": "Bearer s3cret-token-value"}) as resp:
        assert resp.status == 200
        text = await resp.text()
    assert "s3cret-token-value" not in text
    body = yaml.safe_load(text)
    [route] = body["routes"]
    for path, _ in schema.leaves(Route):
        node = route
        for part in path.split("."):
            assert part in node, path
            node = node[part]
    for path, _ in schema.leaves(Config):
        top = path.split(".")[0]
        if top != "routes":
            node = body["settings"]
            for part in path.split("."):
                assert part in node, path
                node = node[part]


def test_every_key_of_the_reference_has_its_own_id_and_the_sections_link_them() -> None:
    """Outside review: a key could not be linked. Each row carries the id of its key path
    (``routes[].retry.per_try_timeout`` -> ``routes.retry.per_try_timeout``), once; the list of
    sections at the top links only ids that exist."""
    import re

    reference = (ROOT / "docs" / "configuration.md").read_text()
    rows = re.findall(r'^\| `([^`]+)` \| .*? \| <a id="([^"]+)"></a>', reference, re.MULTILINE)
    keys = re.findall(r"^\| `([^`]+)` \|", reference, re.MULTILINE)
    assert [k for k, _ in rows] == keys and len(keys) > 40
    assert all(i == k.replace("[]", "") for k, i in rows)
    ids = [i for _, i in rows]
    assert len(ids) == len(set(ids))
    assert "routes.retry.per_try_timeout" in ids
    sections = reference[: reference.index("<!-- config-sections:end -->")]
    linked = re.findall(r"\]\(#([^)]+)\)", sections)
    assert "routes.retry.attempts" in linked and set(linked) <= set(ids)

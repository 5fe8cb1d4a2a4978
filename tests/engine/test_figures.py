"""The per-route figures are computed once (``engine/figures.py``) and every view projects
that one snapshot: GET /status, the status page, the CLI's table, GET /breakers and the
Prometheus gauges agree, figure for figure, and no view reads a route's state itself."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from sidecar.admin import render, verbs
from sidecar.admin.render import View
from sidecar.admin.snapshot import take
from sidecar.engine.figures import BREAKER_GAUGE, RouteFigures
from sidecar.testing import FakeClock
from tests.conftest import reply, routes_yaml
from tests.proc import free_port

ROOT = Path(__file__).resolve().parents[2]
# The modules that show route figures. None may read a route's state or the retry state
# machines: they get RouteFigures, and project it.
VIEWS = (
    "sidecar/admin/snapshot.py",
    "sidecar/admin/render.py",
    "sidecar/admin/verbs.py",
    "sidecar/admin/server.py",
    "sidecar/admin/gauges.py",
    "sidecar/app.py",
)


def imported(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("view", VIEWS)
def test_no_view_reads_route_state_itself(view: str) -> None:
    path = ROOT / view
    assert path.exists(), f"{view} is gone: update VIEWS"
    # app.py wires: it makes the route states (and names the breaker's State for its hook).
    wiring = view == "sidecar/app.py"
    reads = {
        m
        for m in imported(path)
        if not wiring and (m == "sidecar.engine.routestate" or m.startswith("sidecar.retry."))
    }
    assert not reads, f"{view} reads route state itself ({reads}): project RouteFigures"
    text = path.read_text()
    for attr in ("latency", "limiter", "throttle", "endpoints", "budget", "breaker"):
        # st.breaker.counts(...), st.latency.timeout(...): computing a figure in the view
        assert not re.search(rf"\bst\.{attr}\.", text), f"{view} computes {attr} figures"


def gauge(text: str, name: str, labels: str) -> float:
    m = re.search(rf"^retry_sidecar_{name}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
    assert m, f"no {name}{{{labels}}} in the scrape"
    return float(m.group(1))


async def get_json(client: Any, url: str) -> Any:
    async with client.get(url) as resp:
        assert resp.status == 200
        return await resp.json()


async def test_every_view_shows_the_one_snapshot(upstream_factory, sidecar_factory, client):
    """A route whose breaker has opened (failures), retries in its budget, two endpoints (one
    refusing connections) and an adaptive limit: at one instant (a fake clock that does not
    move), every view shows the same figures as the one snapshot."""
    up = await upstream_factory(*[reply(503)] * 40)
    dead = f"http://127.0.0.1:{free_port()}"
    clock = FakeClock()
    sc = await sidecar_factory(
        f"""
version: 1
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0"}}
routes:
  - name: main
    upstream: ["{up.url}", "{dead}"]
    retry: {{attempts: 2, backoff: {{strategy: constant, base: 1ms, max: 1ms}}}}
    breaker: {{failure_ratio: 0.5, min_sequences: 4}}
    bulkhead: {{adaptive: true}}
""",
        clock=clock,
    )
    for _ in range(8):
        async with client.get(sc.url + "/x") as resp:
            await resp.read()
    now = clock.monotonic()
    (figs,) = sc.sidecar.figures.at(now)
    assert figs.breaker == "open" and figs.next_probe_in is not None  # not a trivial state
    assert figs.budget_retries > 0

    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    status = await get_json(client, admin + "/status")
    (st_route,) = status["routes"]
    for f in fields(RouteFigures):
        assert st_route[f.name] == getattr(figs, f.name), f.name

    snap = await take(sc.sidecar.status)
    assert snap.routes[0].figures == figs
    page = render.status_page(snap, View("1m", 0), None, False)
    row = re.search(r'<tr id="route-main">.*?</tr>', page, re.S)
    assert row is not None
    assert f'<td class="num">{figs.budget_left}<br>' in row.group(0)
    assert f"{figs.in_flight}<br><small>of {figs.max_concurrent}" in row.group(0)
    assert f">{figs.breaker}</span>" in row.group(0)

    header, cli_row = verbs.status_rows(status)
    assert cli_row[header.index("BUDGET")] == str(figs.budget_left)
    assert cli_row[header.index("BREAKER")].startswith(figs.breaker + " (probe ")
    assert cli_row[header.index("IN-FLIGHT")] == f"{figs.in_flight}/{figs.max_concurrent}"

    breakers = (await get_json(client, admin + "/breakers"))["routes"]["main"]
    assert breakers["state"] == figs.breaker
    assert (breakers["sequences"], breakers["failures"]) == (
        figs.breaker_sequences,
        figs.breaker_failures,
    )
    assert breakers["budget"] == {"requests": figs.budget_requests, "retries": figs.budget_retries}
    assert breakers["in_flight"] == figs.in_flight

    async with client.get(admin + "/metrics") as resp:
        text = await resp.text()
    main = 'route="main"'
    assert gauge(text, "breaker_state", main) == BREAKER_GAUGE[figs.breaker]
    assert gauge(text, "breaker_open_seconds", main) == figs.breaker_open_for
    assert gauge(text, "per_try_timeout_seconds", main) == figs.per_try_timeout
    assert gauge(text, "throttle_probability", main) == pytest.approx(figs.throttle_probability)
    assert gauge(text, "concurrency_limit", main) == figs.concurrency_limit
    assert gauge(text, "concurrency_in_flight", main) == figs.concurrency_in_flight
    healthy = gauge(text, "endpoints", main + ',state="healthy"')
    ejected = gauge(text, "endpoints", main + ',state="ejected"')
    assert (healthy, ejected) == (figs.endpoints_healthy, figs.endpoints_ejected)


async def test_a_figure_with_a_column_shows_on_the_page_and_in_the_cli(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    """A figure declared with a column (``engine/figures.py``'s COLUMNS) needs nothing more:
    the page and the CLI's table show it under its title, from the snapshot."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    columns = [("per_try_timeout", "per-try timeout"), ("endpoints_healthy", "endpoints up")]
    monkeypatch.setattr(render, "COLUMNS", columns)
    monkeypatch.setattr(verbs, "COLUMNS", columns)
    snap = await take(sc.sidecar.status)
    figs = snap.routes[0].figures
    page = render.status_page(snap, View("1m", 0), None, False)
    assert '<th class="num">per-try timeout</th><th class="num">endpoints up</th>' in page
    cells = f'<td class="num">{figs.per_try_timeout:.2f}</td><td class="num">1</td>'
    assert cells in page
    header, row = verbs.status_rows(snap.as_json())
    at = header.index("PER-TRY TIMEOUT")
    assert header[at + 1] == "ENDPOINTS UP"
    assert row[at : at + 2] == [f"{figs.per_try_timeout:.2f}", "1"]

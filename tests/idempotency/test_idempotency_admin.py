"""Effectively-once writes as an operator sees them: ``GET``/``DELETE /idempotency/<key>``
(token-gated) and the ``retry-sidecar idempotency show|forget`` verbs against the real process,
the counts on ``GET /status``, the status page and ``retry-sidecar status``, and ``explain``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sidecar.config.parse import parse_text
from sidecar.explain import explain
from tests.dlq.test_dlq_cli import cli
from tests.idempotency.test_idempotency_process import WriteApp, call, post
from tests.idempotency.test_idempotency_process import app as app
from tests.proc import SidecarProcess, free_port

pytestmark = pytest.mark.slow
TOKEN = "idem-admin-token-1"


def write_config(tmp_path: Path, app_port: int, port: int, admin: int) -> Path:
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\n'
        f'admin: {{listen: "127.0.0.1:{admin}", token_env: IDEM_TOKEN}}\n'
        f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}\n'
        "routes:\n"
        "  - name: orders\n"
        f'    upstream: "http://127.0.0.1:{app_port}"\n'
        "    idempotency: {enabled: true}\n"
    )
    return cfg


async def test_show_and_forget_a_key_over_the_api_and_the_cli(app: WriteApp, tmp_path, monkeypatch):
    port, admin = free_port(), free_port()
    cfg = write_config(tmp_path, app.port, port, admin)
    proc = SidecarProcess(cfg, env={"IDEM_TOKEN": TOKEN})
    proc.start()
    base = f"http://127.0.0.1:{admin}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        await proc.wait_port(port, admin)
        await post(port, key="ord/1")
        assert (await call("GET", f"{base}/idempotency/ord%2F1"))[0] == 401  # token-gated
        status, _, body = await call("GET", f"{base}/idempotency/ord%2F1", headers=auth)
        shown = json.loads(body)
        assert status == 200 and shown["state"] == "finished"
        assert shown["answer"]["status"] == 201 and shown["answer"]["body_kept"] is True
        assert (await call("GET", f"{base}/idempotency/nope", headers=auth))[0] == 404
        bad = await call("GET", f"{base}/idempotency/k?scope=zz", headers=auth)
        assert bad[0] == 400
        monkeypatch.setenv("IDEM_TOKEN", TOKEN)  # the CLI reads the token the config names
        out = await cli("idempotency", "show", "ord/1", "--config", str(cfg))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["answer"]["status"] == 201
        out = await cli("idempotency", "forget", "ord/1", "--config", str(cfg))
        assert out.returncode == 0 and json.loads(out.stdout)["forgotten"] == "orders/- ord/1"
        again = await cli("idempotency", "forget", "ord/1", "--config", str(cfg))
        assert again.returncode == 1 and again.stderr.startswith("error: 404")
        status, headers, _ = await post(port, key="ord/1")  # forgotten: runs as a first one
        assert status == 201 and "Idempotent-Replayed" not in headers
        assert len(app.writes) == 2
        # The counts, per route, on GET /status, the page and the CLI's table.
        await post(port, key="ord/1")
        status, _, body = await call("GET", f"{base}/status", headers=auth)
        (route,) = json.loads(body)["routes"]
        assert route["idempotency"] == {"first": 2, "replayed": 1}
        status, _, page = await call("GET", f"{base}/", headers=auth)
        assert b"keys: first 2, replayed 1" in page
        table = await cli("status", "--config", str(cfg))
        assert table.returncode == 0 and "KEYS" in table.stdout
        assert "first 2, replayed 1" in table.stdout
    finally:
        proc.terminate()


def test_explain_describes_a_route_that_enables_idempotency():
    text = explain(
        parse_text(
            'version: 1\nroutes:\n  - name: pay\n    upstream: "http://127.0.0.1:9"\n'
            "    timeout: 10s\n    idempotency: {enabled: true, required: true, "
            "scope_header: Authorization}\n"
            '  - name: plain\n    upstream: "http://127.0.0.1:9"\n',
            "<test>",
        )
    )
    pay, plain = text.split("route plain")
    assert "idempotency: PATCH/POST with an Idempotency-Key reach the app once" in pay
    assert "scoped by authorization" in pay.lower() and "no key 400" in pay
    assert "taken over after 15s" in pay  # lease: the route's timeout + 5 s
    assert "idempotency: off" in plain

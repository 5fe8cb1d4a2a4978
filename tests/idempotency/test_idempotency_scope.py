"""``scope_header`` against the real sidecar process: the scope is read from the client's request
as received (whatever the sidecar strips before it goes upstream: hop-by-hop fields, fields named
in ``Connection``, ``Proxy-*``), so a client with another credential, or none, repeating another
client's key and body never gets that client's answer; and a scoped key is found and forgotten
by its key alone (``GET``/``DELETE /idempotency/<key>``, ``retry-sidecar idempotency show|forget``)
on both backends."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from tests.dlq.test_dlq_cli import cli
from tests.idempotency.test_idempotency_process import proc_stack as proc_stack
from tests.idempotency.test_idempotency_process import start
from tests.proc import SidecarProcess
from tests.rawhttp import raw_request
from tests.redisserver import running
from tests.webserver import serve

pytestmark = pytest.mark.slow


@dataclass
class SessionApp:
    """A write that opens a session: each run answers 201 with its number and a cookie."""

    port: int = 0
    runs: list[str] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        self.runs.append(request.path)
        n = len(self.runs)
        return web.json_response(
            {"run": n}, status=201, headers={"Set-Cookie": f"session=secret-{n}"}
        )


@pytest.fixture
async def session_app() -> AsyncIterator[SessionApp]:
    sa = SessionApp()
    async with serve(sa.handle) as sa.port:
        yield sa


# (scope_header, what client A sends, what client B sends instead: another credential or none).
# Each a route of its own (path /<n>), so one sidecar process serves the whole table.
SCOPES: list[tuple[str, bytes, bytes]] = [
    ("Authorization", b"Authorization: Bearer alice\r\n", b"Authorization: Bearer bob\r\n"),
    ("Authorization", b"Authorization: Bearer alice\r\n", b""),
    (
        "Proxy-Authorization",
        b"Proxy-Authorization: Basic YWxpY2U6cHc=\r\n",
        b"Proxy-Authorization: Basic Ym9iOnB3\r\n",
    ),
    ("Proxy-Authorization", b"Proxy-Authorization: Basic YWxpY2U6cHc=\r\n", b""),
    ("Cookie", b"Cookie: sid=alice\r\n", b"Cookie: sid=bob\r\n"),
    ("X-Api-Key", b"X-Api-Key: alice\r\n", b""),
    # A field the client names in Connection: hop-by-hop, stripped before it goes upstream.
    (
        "X-Tenant",
        b"X-Tenant: alice\r\nConnection: X-Tenant, close\r\n",
        b"X-Tenant: bob\r\nConnection: X-Tenant, close\r\n",
    ),
    ("X-Tenant", b"X-Tenant: alice\r\nConnection: X-Tenant, close\r\n", b""),
    # A custom Proxy-* field: every Proxy-* field is stripped.
    ("Proxy-Tenant", b"Proxy-Tenant: alice\r\n", b"Proxy-Tenant: bob\r\n"),
    # A hop-by-hop field by definition (RFC 9110 7.6.1).
    ("Keep-Alive", b"Keep-Alive: alice\r\n", b"Keep-Alive: bob\r\n"),
]


def scoped_routes(app_port: int, tmp_path: Path) -> str:
    routes = "".join(
        f"  - name: r{n}\n"
        f"    match: {{path_prefix: /{n}/}}\n"
        f'    upstream: "http://127.0.0.1:{app_port}"\n'
        f"    idempotency: {{enabled: true, scope_header: {name}}}\n"
        for n, (name, _, _) in enumerate(SCOPES)
    )
    return f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}\nroutes:\n{routes}'


def write(path: str, key: bytes, fields: bytes) -> bytes:
    body = b'{"amount": 100}'
    return (
        b"POST %s HTTP/1.1\r\nHost: shop\r\nIdempotency-Key: %s\r\n%s"
        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
    ) % (path.encode(), key, fields, len(body), body)


async def split_request(port: int, data: bytes, rng: random.Random) -> bytes:
    """``data`` written in pieces cut at random byte boundaries; what came back until close."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    cuts = sorted(rng.sample(range(1, len(data)), 5))
    for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True):
        w.write(data[a:b])
        await w.drain()
        await asyncio.sleep(0)
    out = await r.read()
    w.close()
    return out


async def test_a_client_with_another_scope_never_gets_anothers_answer(
    session_app: SessionApp, tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    """Client A writes with its credential; client B (another credential, or none) repeats A's
    key and body: B's write runs (its own answer, its own cookie), never A's replayed. A's own
    duplicate is still replayed: the scope holds."""
    port, _ = await start(proc_stack, tmp_path, scoped_routes(session_app.port, tmp_path))
    rng = random.Random(29)
    for n, (name, a, b) in enumerate(SCOPES):
        path, key = f"/{n}/pay", b"pay-%d" % n  # keys are not per route: one each
        first = await raw_request(port, write(path, key, a))
        assert first.startswith(b"HTTP/1.1 201"), (name, first)
        secret = first.split(b"session=", 1)[1].split(b"\r\n", 1)[0]
        other = await raw_request(port, write(path, key, b))
        assert other.startswith(b"HTTP/1.1 201"), (name, other)
        assert b"Idempotent-Replayed" not in other, (name, b, other)
        assert secret not in other, (name, b, other)  # not A's cookie, nor A's body
        # B again, as HTTP/1.0 and split at random byte boundaries: B's own answer at most.
        http10 = write(path, key, b).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
        for again in (
            await raw_request(port, http10),
            await split_request(port, write(path, key, b), rng),
        ):
            assert b" 201 " in again.split(b"\r\n", 1)[0] and secret not in again, (name, again)
        again = await raw_request(port, write(path, key, a))
        assert b"Idempotent-Replayed: true" in again and secret in again, (name, again)
    assert len(session_app.runs) == 2 * len(SCOPES)


async def admin_get(admin: int, method: str, path: str) -> tuple[int, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as s,
        s.request(method, f"http://127.0.0.1:{admin}{path}") as r,
    ):
        return r.status, await r.json()


@pytest.mark.parametrize("backend", ["sqlite", "redis"])
async def test_a_scoped_key_is_found_and_forgotten_by_the_key_alone(
    session_app: SessionApp, tmp_path: Path, proc_stack: list[SidecarProcess], backend: str
) -> None:
    """On a route with ``scope_header``, the admin API and ``retry-sidecar idempotency
    show|forget`` find a key by the key alone: every scope holding it listed by a label (never
    the credential), one scope shown at the top level; a forget of a key two scopes hold asks
    which; ``--scope LABEL`` names one."""
    with ExitStack() as stack:
        if backend == "sqlite":
            store = f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}\n'
        else:
            server = stack.enter_context(running(tmp_path / "redis"))
            store = f'idempotency: {{backend: redis}}\nfleet: {{redis: {{url: "{server.url}"}}}}\n'
        body = (
            f"{store}routes:\n  - name: pay\n"
            f'    upstream: "http://127.0.0.1:{session_app.port}"\n'
            "    idempotency: {enabled: true, scope_header: Authorization}\n"
        )
        port, admin = await start(proc_stack, tmp_path, body)
        cfg = str(tmp_path / "sidecar.yaml")
        alice, bob = (
            b"Authorization: Bearer alice-secret\r\n",
            b"Authorization: Bearer bob-secret\r\n",
        )
        for who, key in ((alice, b"solo"), (alice, b"ord-1"), (bob, b"ord-1")):
            assert (await raw_request(port, write("/pay", key, who))).startswith(b"HTTP/1.1 201")

        status, solo = await admin_get(admin, "GET", "/idempotency/solo")
        assert status == 200 and solo["state"] == "finished", solo
        (one,) = solo["scopes"]
        assert one["scope"] == solo["scope"] and len(str(solo["scope"])) == 12
        out = await cli("idempotency", "show", "ord-1", "--config", cfg)
        assert out.returncode == 0, out.stderr
        both = json.loads(out.stdout)
        labels = sorted(s["scope"] for s in both["scopes"])
        assert both["key"] == "ord-1" and len(set(labels)) == 2 and "state" not in both
        assert "alice" not in out.stdout and "bob" not in out.stdout  # not the credentials
        out = await cli("idempotency", "forget", "ord-1", "--config", cfg)
        assert out.returncode == 1 and "held in 2 scopes" in out.stderr, out.stderr
        assert "never seen" not in out.stderr
        out = await cli("idempotency", "forget", "ord-1", "--scope", labels[0], "--config", cfg)
        assert out.returncode == 0 and json.loads(out.stdout)["scope"] == labels[0], out.stderr
        status, left = await admin_get(admin, "GET", "/idempotency/ord-1")
        assert status == 200 and [s["scope"] for s in left["scopes"]] == [labels[1]]
        out = await cli("idempotency", "forget", "solo", "--config", cfg)
        assert out.returncode == 0, out.stderr
        out = await cli("idempotency", "show", "solo", "--config", cfg)
        assert out.returncode == 1 and "404" in out.stderr and "in any scope" in out.stderr


async def test_a_support_engineer_finds_a_customers_scope_by_the_value_they_send(
    session_app: SessionApp, tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    """Outside finding (issue 29): ``show`` lists scopes by a label and nothing said what it is
    a digest of. ``--scope-value`` computes the scope from the header value the customer sends,
    credentials normalised as the route does (scheme case, spaces), here; only the digest goes
    to the admin API. ``-`` reads the value from stdin (kept out of the shell's history)."""
    body = (
        f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}\nroutes:\n'
        "  - name: tenant\n    match: {path_prefix: /tenant}\n"
        f'    upstream: "http://127.0.0.1:{session_app.port}"\n'
        "    idempotency: {enabled: true, scope_header: X-Tenant}\n"
        "  - name: pay\n"
        f'    upstream: "http://127.0.0.1:{session_app.port}"\n'
        "    idempotency: {enabled: true, scope_header: Authorization}\n"
    )
    port, _ = await start(proc_stack, tmp_path, body)
    cfg = str(tmp_path / "sidecar.yaml")
    alice, bob = b"Authorization: bearer   alice-secret\r\n", b"Authorization: Bearer bob\r\n"
    for who in (alice, bob):
        assert (await raw_request(port, write("/pay", b"ord-1", who))).startswith(b"HTTP/1.1 201")
    tenant = write("/tenant", b"ord-2", b"X-Tenant: acme\r\n")
    assert (await raw_request(port, tenant)).startswith(b"HTTP/1.1 201")
    out = await cli("idempotency", "show", "ord-1", "--config", cfg)
    labels = {s["scope"]: s for s in json.loads(out.stdout)["scopes"]}

    out = await cli(
        "idempotency", "show", "ord-1", "--scope-value", "Bearer alice-secret", "--config", cfg
    )
    assert out.returncode == 0, out.stderr
    shown = json.loads(out.stdout)
    assert shown["scope"] in labels and shown["state"] == "finished", shown
    assert f"scope label of that Authorization value: {shown['scope']}" in out.stderr
    assert "alice-secret" not in out.stdout + out.stderr
    out = await cli(
        "idempotency", "show", "ord-1", "--scope-value", "Bearer carol", "--config", cfg
    )
    assert out.returncode == 1 and "404" in out.stderr, out.stderr
    out = await cli(
        "idempotency", "show", "ord-2", "--scope-value", "acme", "--scope-header", "X-Tenant",
        "--config", cfg,
    )  # fmt: skip
    assert out.returncode == 0 and json.loads(out.stdout)["state"] == "finished", out.stderr

    forget = [sys.executable, "-m", "sidecar", "idempotency", "forget", "ord-1"]
    done = await asyncio.to_thread(
        subprocess.run,
        [*forget, "--scope-value", "-", "--config", cfg],
        input="BEARER bob\n",
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    gone = json.loads(done.stdout)["scope"]
    assert gone in labels and gone != shown["scope"]
    out = await cli("idempotency", "show", "ord-1", "--config", cfg)
    assert [s["scope"] for s in json.loads(out.stdout)["scopes"]] == [shown["scope"]]

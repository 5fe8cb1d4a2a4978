"""Effectively-once writes from outside: the real sidecar process (uvloop, as shipped)
in front of a real app on loopback that knows nothing of keys and counts the writes it runs.
One test per bullet of the contract: first / replayed / 409 in progress with Retry-After / 422 /
400 missing and malformed / 503 store error (refuse and pass), 50 concurrent duplicates over
several connections, SIGKILL mid-request and the lease, a kept answer across a restart, hot
reload on and off, the client gone mid-forward, and the raw-wire variants."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import sqlite3
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from tests.proc import SidecarProcess, start_process
from tests.rawhttp import raw_request
from tests.wait import until, until_async
from tests.webserver import serve

pytestmark = pytest.mark.slow

TIMEOUT = aiohttp.ClientTimeout(total=30)


@dataclass
class WriteApp:
    """The app behind the sidecar: every POST is a write it runs (counted by body), answered
    201 with the write's number. ``gate``: writes wait for it (a slow app)."""

    port: int = 0
    writes: list[bytes] = field(default_factory=list)
    entered: asyncio.Event = field(default_factory=asyncio.Event)
    gate: asyncio.Event | None = None
    status: int = 201
    extra: dict[str, str] = field(default_factory=dict)  # more headers on its answers

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if request.method == "GET":
            return web.Response(text="read")
        self.entered.set()
        if self.gate is not None:
            await self.gate.wait()
        self.writes.append(body)
        return web.json_response(
            {"write": len(self.writes)},
            status=self.status,
            headers={"X-App": "yes", **self.extra},
        )


@pytest.fixture
async def app() -> AsyncIterator[WriteApp]:
    wa = WriteApp()
    async with serve(wa.handle) as wa.port:
        yield wa
        if wa.gate is not None:
            wa.gate.set()  # a handler held at the gate ends before the server is cleaned up


def config(app: WriteApp, tmp_path: Path, idem: str = "{enabled: true}", extra: str = "") -> str:
    return (
        f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}\n'
        "routes:\n"
        "  - name: orders\n"
        f'    upstream: "http://127.0.0.1:{app.port}"\n'
        f"    idempotency: {idem}\n"
        f"{extra}"
    )


@pytest.fixture
async def proc_stack() -> AsyncIterator[list[SidecarProcess]]:
    started: list[SidecarProcess] = []
    yield started
    for p in started:
        p.terminate()


async def start(stack: list[SidecarProcess], tmp_path: Path, body: str) -> tuple[int, int]:
    proc, port, admin = await start_process(tmp_path, body)
    stack.append(proc)
    return port, admin


async def call(method: str, url: str, **kw: object) -> tuple[int, dict[str, str], bytes]:
    async with (
        aiohttp.ClientSession(timeout=TIMEOUT) as s,
        s.request(method, url, **kw) as r,  # type: ignore[arg-type]
    ):
        return r.status, dict(r.headers), await r.read()


async def post(
    port: int, body: bytes = b'{"sku": 1}', key: str | None = "k1", path: str = "/orders"
) -> tuple[int, dict[str, str], bytes]:
    headers = {} if key is None else {"Idempotency-Key": key}
    return await call("POST", f"http://127.0.0.1:{port}{path}", data=body, headers=headers)


async def counts(admin: int, route: str = "orders") -> dict[str, float]:
    text = (await call("GET", f"http://127.0.0.1:{admin}/metrics"))[2].decode()
    out: dict[str, float] = {}
    prefix = f'retry_sidecar_idempotency_total{{route="{route}",result="'
    for line in text.splitlines():
        if line.startswith(prefix):
            result, value = line[len(prefix) :].split('"} ')
            out[result] = float(value)
    return out


def problem(body: bytes, kind: str) -> dict[str, object]:
    doc = json.loads(body)
    assert doc["type"] == f"urn:retry-sidecar:problem:idempotency:{kind}", doc
    assert {"type", "title", "detail", "key", "status"} <= set(doc)
    return dict(doc)


async def test_first_replayed_mismatch_and_bad_keys(app, tmp_path, proc_stack):
    port, admin = await start(proc_stack, tmp_path, config(app, tmp_path))
    status, headers, body = await post(port)
    assert (status, json.loads(body)) == (201, {"write": 1})
    assert "Idempotent-Replayed" not in headers
    status, headers, again = await post(port)
    assert (status, again, headers["Idempotent-Replayed"]) == (201, body, "true")
    assert headers["X-App"] == "yes"  # the kept answer's end-to-end headers
    status, headers, other = await post(port, body=b'{"sku": 2}')  # same key, other request
    assert status == 422 and headers["Content-Type"] == "application/problem+json"
    assert problem(other, "key-reused")["key"] == "k1"
    for bad in ("", '"open', "x" * 256, "caf\u00e9"):
        status, headers, made = await post(port, key=bad)
        assert status == 400 and headers["Content-Type"] == "application/problem+json", bad
        problem(made, "key-invalid")
    status, _, quoted = await post(port, key='"k1"')  # the draft's sf-string: the same key
    assert (status, quoted) == (201, body)
    status, _, _ = await post(port, key=None)  # not required: passes, unguarded
    assert status == 201
    read = await call("GET", f"http://127.0.0.1:{port}/orders", headers={"Idempotency-Key": ""})
    assert read[0] == 200  # a read is never guarded
    assert len(app.writes) == 2  # the first write and the keyless one, nothing else
    seen = await counts(admin)
    assert seen["first"] == 1 and seen["replayed"] == 2 and seen["mismatch"] == 1
    assert seen["invalid"] == 4 and seen["missing"] == 1


async def test_required_key_missing_is_400_and_never_reaches_the_app(app, tmp_path, proc_stack):
    port, admin = await start(
        proc_stack, tmp_path, config(app, tmp_path, "{enabled: true, required: true}")
    )
    status, headers, body = await post(port, key=None)
    assert status == 400 and headers["Content-Type"] == "application/problem+json"
    assert problem(body, "key-missing")["key"] is None
    assert app.writes == [] and not app.entered.is_set()
    assert (await counts(admin))["missing"] == 1


async def test_a_duplicate_while_the_first_runs_gets_409_with_retry_after(
    app, tmp_path, proc_stack
):
    port, admin = await start(proc_stack, tmp_path, config(app, tmp_path))
    app.gate = asyncio.Event()
    first = asyncio.create_task(post(port))
    await app.entered.wait()
    status, headers, body = await post(port)
    assert status == 409 and int(headers["Retry-After"]) >= 1
    problem(body, "in-progress")
    app.gate.set()
    status, _, _ = await first
    assert status == 201 and len(app.writes) == 1
    assert (await counts(admin))["in-progress"] == 1


async def test_an_answer_the_route_retries_releases_the_key(app, tmp_path, proc_stack):
    app.status = 503  # in retry_on by default: the client's retry must run
    port, admin = await start(
        proc_stack, tmp_path, config(app, tmp_path, extra="    retry: {attempts: 1}\n")
    )
    assert (await post(port))[0] == 503
    app.status = 201
    status, headers, _ = await post(port)
    assert status == 201 and "Idempotent-Replayed" not in headers
    assert len(app.writes) == 2
    seen = await counts(admin)
    assert seen["released"] == 1 and seen["first"] == 1


async def test_an_answer_before_the_app_began_releases_the_key(app, tmp_path, proc_stack):
    """408, 425, 429 (not in ``retry_on``: the route does not retry them) and any error with
    ``Retry-After`` say the app did not begin the write: never kept, the client's retry with
    its key runs (and is kept). A 202 with ``Retry-After`` (poll later) is kept: the app acted."""
    port, admin = await start(
        proc_stack, tmp_path, config(app, tmp_path, extra="    retry: {attempts: 1}\n")
    )
    rows = [
        (429, {"Retry-After": "1"}),
        (429, {}),
        (408, {}),
        (425, {}),
        (409, {"Retry-After": "2"}),
    ]
    for n, (status, extra) in enumerate(rows):
        app.status, app.extra = status, extra
        assert (await post(port, key=f"early-{n}"))[0] == status
        app.status, app.extra = 201, {}
        again, headers, _ = await post(port, key=f"early-{n}")
        assert again == 201 and "Idempotent-Replayed" not in headers, (status, extra)
        assert (await post(port, key=f"early-{n}"))[1]["Idempotent-Replayed"] == "true"
    app.status, app.extra = 202, {"Retry-After": "5"}
    assert (await post(port, key="poll"))[0] == 202
    status, headers, _ = await post(port, key="poll")
    assert status == 202 and headers["Idempotent-Replayed"] == "true"
    assert len(app.writes) == 2 * len(rows) + 1
    seen = await counts(admin)
    assert seen["released"] == len(rows) and seen["first"] == len(rows) + 1


@pytest.mark.parametrize("on_error", ["refuse", "pass"])
async def test_store_unreachable_refuse_or_pass(app, tmp_path, proc_stack, on_error):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the store's directory should be")
    body = config(app, tmp_path, f"{{enabled: true, on_store_error: {on_error}}}").replace(
        f"{tmp_path}/keys.sqlite3", f"{blocker}/keys.sqlite3"
    )
    port, admin = await start(proc_stack, tmp_path, body)
    status, headers, made = await post(port)
    if on_error == "refuse":
        assert status == 503 and headers["Content-Type"] == "application/problem+json"
        problem(made, "store-unavailable")
        assert app.writes == []
        # as every answer the sidecar makes itself: why, how it ended, no attempt made
        assert headers["x-retry-proxy-error"] == "idempotency-store"
        assert (headers["x-retry-fate"], headers["x-retry-attempts"]) == ("not-retryable", "0")

        def access() -> list[dict[str, object]]:
            lines = proc_stack[-1].stderr().splitlines()
            return [json.loads(line) for line in lines if '"sidecar.access"' in line]

        await until(access, "the refusal's access line")  # written just after the answer
        assert access()[-1]["upstream"] is None
        assert access()[-1]["proxy_error"] == "idempotency-store", access()[-1]
    else:
        assert status == 201 and len(app.writes) == 1
    assert (await counts(admin))["store-error"] == 1


async def test_fifty_concurrent_duplicates_reach_the_app_once(app, tmp_path, proc_stack):
    port, admin = await start(proc_stack, tmp_path, config(app, tmp_path))
    app.gate = asyncio.Event()
    rng = random.Random(23)
    sessions = [
        aiohttp.ClientSession(timeout=TIMEOUT, connector=aiohttp.TCPConnector(limit=3))
        for _ in range(5)
    ]

    async def one(i: int) -> tuple[int, bytes]:
        await asyncio.sleep(rng.random() * 0.05)
        s = sessions[i % len(sessions)]
        url = f"http://127.0.0.1:{port}/orders"
        async with s.post(url, data=b'{"sku": 1}', headers={"Idempotency-Key": "dup"}) as r:
            return r.status, await r.read()

    try:
        tasks = [asyncio.create_task(one(i)) for i in range(50)]
        await app.entered.wait()
        await until(lambda: sum(t.done() for t in tasks) >= 10, "duplicates answered 409")
        app.gate.set()
        results = await asyncio.gather(*tasks)
    finally:
        for s in sessions:
            await s.close()
    assert len(app.writes) == 1
    statuses = [s for s, _ in results]
    assert set(statuses) <= {201, 409} and statuses.count(201) >= 1
    seen = await counts(admin)
    assert seen["first"] == 1 and seen["in-progress"] == statuses.count(409)
    # Once finished, every duplicate is the kept answer.
    status, headers, _ = await post(port, key="dup")
    assert status == 201 and headers["Idempotent-Replayed"] == "true"


async def test_a_kept_answer_survives_a_restart(app, tmp_path, proc_stack):
    body = config(app, tmp_path)
    port, _ = await start(proc_stack, tmp_path, body)
    first = await post(port)
    assert proc_stack.pop().terminate() == 0
    port, _ = await start(proc_stack, tmp_path, body)
    status, headers, again = await post(port)
    assert (status, again, headers["Idempotent-Replayed"]) == (201, first[2], "true")
    assert len(app.writes) == 1


async def test_sigkill_mid_request_holds_the_key_until_its_lease(app, tmp_path, proc_stack):
    body = config(app, tmp_path, "{enabled: true, lease: 2s}")
    port, _ = await start(proc_stack, tmp_path, body)
    app.gate = asyncio.Event()
    first = asyncio.create_task(post(port))
    await app.entered.wait()
    killed = proc_stack.pop()
    assert killed.proc is not None
    killed.proc.send_signal(signal.SIGKILL)
    killed.proc.wait()
    with pytest.raises(aiohttp.ClientError):
        await first
    app.gate.set()  # the app finished the write; its answer had nobody to reach
    port, admin = await start(proc_stack, tmp_path, body)
    status, _, _ = await post(port)
    assert status == 409  # still in progress: the dead holder's lease has not passed
    answers: list[int] = []

    async def through() -> bool:
        answers.append((await post(port))[0])
        return answers[-1] != 409

    await until_async(through, "the lease to pass")
    assert answers[-1] == 201
    assert len(app.writes) == 2  # at-least-once after a lease: said in docs/idempotency.md
    assert (await counts(admin))["lease-expired"] == 1


async def test_reload_turns_idempotency_on_and_off(app, tmp_path, proc_stack):
    off = config(app, tmp_path, "{enabled: false}")
    proc, port, admin = await start_process(tmp_path, off)
    proc_stack.append(proc)
    await post(port)
    await post(port)
    assert len(app.writes) == 2  # off: nothing guarded
    assert not (tmp_path / "keys.sqlite3").exists()  # nothing opened for nobody
    text = proc.config_path.read_text()
    proc.config_path.write_text(text.replace("{enabled: false}", "{enabled: true}"))
    reloaded = await call("POST", f"http://127.0.0.1:{admin}/config/reload")
    assert reloaded[0] == 200, reloaded
    await until_async(lambda: _guarded(port), "the reload to guard the route")
    n = len(app.writes)
    status, headers, _ = await post(port, key="after-on")
    assert status == 201 and headers["Idempotent-Replayed"] == "true"
    assert len(app.writes) == n
    proc.config_path.write_text(text)
    reloaded = await call("POST", f"http://127.0.0.1:{admin}/config/reload")
    assert reloaded[0] == 200, reloaded
    await post(port, key="after-on")
    assert len(app.writes) == n + 1  # off again: the key is not read


async def _guarded(port: int) -> bool:
    status, headers, _ = await post(port, key="after-on")
    return status == 201 and "Idempotent-Replayed" not in headers and "x-retry-fate" in headers


REQUEST = (
    b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: wire\r\n"
    b'Content-Length: 11\r\n\r\n{"sku": 7}\n'
)


async def test_raw_wire_variants_of_a_guarded_write(app, tmp_path, proc_stack):
    """The same write split at random byte boundaries, as HTTP/1.0 and with Connection:
    close: one write at the app, every later copy the kept answer, framed for its client."""
    port, _ = await start(proc_stack, tmp_path, config(app, tmp_path))
    rng = random.Random(7)
    for _ in range(5):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        cuts = sorted(rng.sample(range(1, len(REQUEST)), 4))
        for a, b in zip([0, *cuts], [*cuts, len(REQUEST)], strict=True):
            w.write(REQUEST[a:b])
            await w.drain()
            await asyncio.sleep(0)
        head = await r.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 201"), head
        w.close()
    http10 = REQUEST.replace(b"HTTP/1.1", b"HTTP/1.0")
    out = await raw_request(port, http10)
    assert out.startswith(b"HTTP/1.0 201") and b"Idempotent-Replayed: true" in out
    assert out.endswith(b'{"write": 1}')
    closing = REQUEST.replace(b"Host: x\r\n", b"Host: x\r\nConnection: close\r\n")
    out = await raw_request(port, closing)
    assert out.startswith(b"HTTP/1.1 201") and b"Connection: close" in out
    assert b"Idempotent-Replayed: true" in out and out.endswith(b'{"write": 1}')
    assert len(app.writes) == 1


async def test_a_body_over_the_buffer_gets_413_and_is_not_sent(app, tmp_path, proc_stack):
    port, _ = await start(
        proc_stack, tmp_path, config(app, tmp_path, extra="    retry: {max_body_bytes: 16}\n")
    )
    status, headers, body = await post(port, body=b"x" * 17)
    assert status == 413 and headers["Content-Type"] == "application/problem+json"
    problem(body, "body-too-large")
    chunked = (
        b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: big\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n11\r\n" + b"y" * 17 + b"\r\n0\r\n\r\n"
    )
    assert (await raw_request(port, chunked)).startswith(b"HTTP/1.1 413")
    assert app.writes == []


@dataclass
class LossyLink:
    """A TCP link between two sidecars that loses the first answer of each path it is told
    to: it forwards the request, waits for the answer's first bytes, then closes the
    caller's connection without passing them on (the answer lost on the way back)."""

    target: int
    lose: set[str] = field(default_factory=set)  # request paths whose first answer is lost
    lost: list[str] = field(default_factory=list)

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ur, uw = await asyncio.open_connection("127.0.0.1", self.target)
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":", 1)[1])
                uw.write(head + await r.readexactly(length))
                await uw.drain()
                path = head.split(b" ")[1].decode()
                answer = await ur.read(65536)
                if path in self.lose and path not in self.lost:
                    self.lost.append(path)
                    w.transport.abort()  # the answer never reaches the edge
                    return
                w.write(answer)
                await w.drain()
        finally:
            uw.close()


async def test_a_chain_of_two_sidecars_gives_effectively_once_end_to_end(app, tmp_path, proc_stack):
    """Edge (retries a POST with a key on a reset) -> a link that loses the first answer ->
    inner (idempotency on /guarded, off on /plain) -> an app that knows nothing of keys.
    The answer to the first attempt is lost after the app ran the write: the edge retries;
    the inner answers the retry with the kept answer, so the write runs once and the client
    gets its success. The control path, unguarded, runs the write twice."""
    (tmp_path / "inner").mkdir()
    (tmp_path / "edge").mkdir()
    inner_body = (
        f'idempotency: {{path: "{tmp_path}/inner/keys.sqlite3"}}\n'
        "routes:\n"
        "  - name: guarded\n"
        "    match: {path_prefix: /guarded}\n"
        f'    upstream: "http://127.0.0.1:{app.port}"\n'
        "    idempotency: {enabled: true}\n"
        "  - name: plain\n"
        f'    upstream: "http://127.0.0.1:{app.port}"\n'
    )
    inner_port, inner_admin = await start(proc_stack, tmp_path / "inner", inner_body)
    link = LossyLink(inner_port, lose={"/guarded", "/plain"})
    server = await asyncio.start_server(link.handle, "127.0.0.1", 0)
    link_port = server.sockets[0].getsockname()[1]
    try:
        edge_body = (
            "routes:\n"
            "  - name: edge\n"
            f'    upstream: "http://127.0.0.1:{link_port}"\n'
            "    retry: {attempts: 3, backoff: {strategy: constant, base: 1ms, max: 1ms}}\n"
        )
        edge_port, _ = await start(proc_stack, tmp_path / "edge", edge_body)
        status, headers, body = await post(edge_port, key="order-1", path="/guarded")
        assert link.lost == ["/guarded"]
        assert status == 201 and headers["x-retry-attempts"] == "2"
        assert headers["Idempotent-Replayed"] == "true"  # the inner kept the lost answer
        assert json.loads(body) == {"write": 1} and len(app.writes) == 1
        assert (await counts(inner_admin, "guarded"))["replayed"] == 1
        # The control: the same loss on a route without the guard runs the write twice.
        status, _, body = await post(edge_port, key="order-2", path="/plain")
        assert link.lost == ["/guarded", "/plain"]
        assert status == 201 and json.loads(body) == {"write": 3} and len(app.writes) == 3
    finally:
        server.close()
        await server.wait_closed()


async def test_a_duplicate_of_a_write_the_dlq_stored_gets_the_stored_marker(
    app, tmp_path, proc_stack
):
    """``respond: passthrough``: the client got the app's 503 with ``x-retry-dlq: stored`` and
    its record id; a duplicate gets that same answer replayed, the DLQ's headers included."""
    app.status = 503
    extra = (
        "    dlq: {enabled: true, respond: passthrough}\n"
        "    retry: {attempts: 1}\n"
        f'dlq: {{path: "{tmp_path}/dlq.sqlite3"}}\n'
    )
    port, _ = await start(proc_stack, tmp_path, config(app, tmp_path, extra=extra))
    status, first, _ = await post(port, key="stored")
    assert status == 503 and first["x-retry-dlq"] == "stored", first
    status, again, _ = await post(port, key="stored")
    assert status == 503 and again["Idempotent-Replayed"] == "true"
    assert again["x-retry-dlq"] == "stored"
    assert again["x-retry-dlq-id"] == first["x-retry-dlq-id"]
    assert len(app.writes) == 1


async def test_scope_header_authorization_ignores_how_the_scheme_is_spelled(
    app, tmp_path, proc_stack
):
    """``scope_header: Authorization``: a retry whose library spells the auth-scheme otherwise
    (``bearer``, two spaces) is the same client: replayed, not run again."""
    port, _ = await start(
        proc_stack, tmp_path, config(app, tmp_path, "{enabled: true, scope_header: Authorization}")
    )
    url = f"http://127.0.0.1:{port}/orders"
    first = await call(
        "POST", url, data=b"{}", headers={"Idempotency-Key": "a", "Authorization": "Bearer tok"}
    )
    assert first[0] == 201
    for spelled in ("bearer tok", "BEARER  tok"):
        again = await call(
            "POST", url, data=b"{}", headers={"Idempotency-Key": "a", "Authorization": spelled}
        )
        assert (again[0], again[1].get("Idempotent-Replayed")) == (201, "true"), spelled
    other = await call(
        "POST", url, data=b"{}", headers={"Idempotency-Key": "a", "Authorization": "Bearer TOK"}
    )
    assert other[0] == 201 and "Idempotent-Replayed" not in other[1]  # another client
    assert len(app.writes) == 2


async def test_the_sidecars_own_answers_carry_proxy_status_and_date(app, tmp_path, proc_stack):
    """Every answer the sidecar makes itself carries Proxy-Status (RFC 9209) and Date (RFC 9110
    6.6.1): the problems name their error type, a replay names the sidecar; a replayed 204
    carries no Content-Length (RFC 9110 8.6), as the original had none."""
    port, _ = await start(proc_stack, tmp_path, config(app, tmp_path))
    await post(port)
    app.gate = asyncio.Event()
    running = asyncio.create_task(post(port, key="busy"))
    await app.entered.wait()
    answers = {
        "invalid": await post(port, key="x" * 256),
        "in-progress": await post(port, key="busy"),
        "mismatch": await post(port, body=b"other"),
    }
    app.gate.set()
    await running
    for kind, (status, headers, _) in answers.items():
        assert status in (400, 409, 422), kind
        assert headers["Proxy-Status"] == "retry-sidecar; error=http_request_error", kind
        assert "GMT" in headers["Date"], kind
    status, headers, _ = await post(port)
    assert headers["Idempotent-Replayed"] == "true"
    assert headers["Proxy-Status"] == "retry-sidecar" and "GMT" in headers["Date"]
    app.status = 204
    request = (
        b"POST /orders HTTP/1.1\r\nHost: x\r\nIdempotency-Key: empty\r\n"
        b"Connection: close\r\nContent-Length: 2\r\n\r\n{}"
    )
    first = await raw_request(port, request)
    assert first.startswith(b"HTTP/1.1 204") and b"content-length" not in first.lower()
    again = await raw_request(port, request)
    assert again.startswith(b"HTTP/1.1 204") and b"Idempotent-Replayed: true" in again
    assert b"content-length" not in again.lower(), again


@pytest.mark.parametrize("on_error", ["refuse", "pass"])
async def test_at_its_bound_the_store_refuses_new_keys_by_on_store_error(
    app: WriteApp, tmp_path: Path, proc_stack: list[SidecarProcess], on_error: str
) -> None:
    """Issue 29 item 7: ``idempotency.max_records`` / ``max_bytes`` bound the file. At the
    bound a new key follows the route's ``on_store_error`` (503 ``store-unavailable``, or the
    write forwarded unguarded, exactly once) and is counted ``store-full``; the keys it holds
    are still replayed, and a key forgotten makes room again."""
    body = (
        f'idempotency: {{path: "{tmp_path}/keys.sqlite3", max_records: 2, max_bytes: 1MiB}}\n'
        "routes:\n  - name: orders\n"
        f'    upstream: "http://127.0.0.1:{app.port}"\n'
        f"    idempotency: {{enabled: true, on_store_error: {on_error}}}\n"
    )
    port, admin = await start(proc_stack, tmp_path, body)
    assert (await post(port, key="a"))[0] == 201
    assert (await post(port, key="b"))[0] == 201
    status, _, made = await post(port, key="c")
    if on_error == "refuse":
        assert status == 503
        problem(made, "store-unavailable")
        assert len(app.writes) == 2
    else:
        assert (status, json.loads(made)) == (201, {"write": 3})
    status, headers, _ = await post(port, key="a")  # a key it holds: replayed
    assert (status, headers.get("Idempotent-Replayed")) == (201, "true")
    seen = await counts(admin)
    assert (seen["store-full"], seen.get("store-error", 0)) == (1, 0)
    assert len(app.writes) == (2 if on_error == "refuse" else 3)


async def test_max_bytes_bounds_the_kept_answers(
    app: WriteApp, tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    """Near ``max_bytes`` an answer is kept without its body (counted ``store-full``, the key
    finished all the same); past it, no new key (refused, counted ``store-full`` too)."""
    body = (
        f'idempotency: {{path: "{tmp_path}/keys.sqlite3", max_bytes: 300}}\n'
        "routes:\n  - name: orders\n"
        f'    upstream: "http://127.0.0.1:{app.port}"\n'
        "    idempotency: {enabled: true}\n"
    )
    port, admin = await start(proc_stack, tmp_path, body)
    sent = 0
    while (status := (await post(port, key=f"k{sent}"))[0]) == 201:
        sent += 1
        assert sent < 20, "never refused"
    assert status == 503 and sent >= 1
    # Every answer kept without its body and the refusal: one count each.
    with contextlib.closing(sqlite3.connect(tmp_path / "keys.sqlite3")) as conn:
        (bodiless,) = conn.execute(
            "SELECT COUNT(*) FROM idempotency_keys WHERE finished = 1 AND body IS NULL"
        ).fetchone()
    assert (await counts(admin))["store-full"] == bodiless + 1


# Heads an app may send that the sidecar refuses to relay (502 bad-response): the app ran the
# write all the same.
BAD_HEADS = {
    "manyhdr": b"HTTP/1.1 201 Created\r\n"
    + b"".join(b"X-H%d: v\r\n" % i for i in range(210))
    + b"Content-Length: 2\r\n\r\nok",
    "tegzip": b"HTTP/1.1 201 Created\r\nTransfer-Encoding: gzip, chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
    "s600": b"HTTP/1.1 600 Weird\r\nContent-Length: 2\r\n\r\nok",
}


async def test_an_answer_the_sidecar_cannot_relay_finishes_the_key(tmp_path, proc_stack):
    """The app runs the write and answers with a head the sidecar refuses (too many fields, a
    transfer coding it cannot relay, status 600): the client gets 502 bad-response, and the key
    is finished with it (the app began the write), so the client's retries with the key get
    that 502 replayed and never run the write again."""
    runs: dict[str, int] = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n")[1:]:
                    name, _, value = line.partition(b":")
                    if name.strip().lower() == b"content-length":
                        length = int(value)
                await reader.readexactly(length)
                kind = head.split(b" ")[1].rsplit(b"/", 1)[-1].decode()
                runs[kind] = runs.get(kind, 0) + 1
                writer.write(BAD_HEADS[kind])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    try:
        upstream = WriteApp(port=server.sockets[0].getsockname()[1])
        port, admin = await start(proc_stack, tmp_path, config(upstream, tmp_path))
        for kind in BAD_HEADS:
            status, headers, body = await post(port, key=f"bad-{kind}", path=f"/p/{kind}")
            assert status == 502 and headers["x-retry-proxy-error"] == "bad-response", kind
            for _ in range(2):
                again, replayed, body2 = await post(port, key=f"bad-{kind}", path=f"/p/{kind}")
                assert again == 502 and replayed["Idempotent-Replayed"] == "true", kind
                assert json.loads(body2) == json.loads(body)
        assert runs == {kind: 1 for kind in BAD_HEADS}
        seen = await counts(admin)
        assert seen["first"] == len(BAD_HEADS) and seen["replayed"] == 2 * len(BAD_HEADS)
        assert seen.get("released", 0) == 0
    finally:
        server.close()
        await server.wait_closed()


async def test_the_same_key_on_two_routes_is_two_keys(tmp_path, proc_stack):
    """Two routes told apart by Host (two apps), both guarding writes, no ``scope_header``: the
    same key, path and body on green after blue runs green's write (never blue's kept answer),
    each is replayed on its own route, and the admin API finds the key on both by the key
    alone, naming route and scope."""
    blue, green = WriteApp(), WriteApp()
    async with serve(blue.handle) as blue.port, serve(green.handle) as green.port:
        body = (
            f'idempotency: {{path: "{tmp_path}/keys.sqlite3"}}\n'
            "defaults:\n  idempotency: {enabled: true}\n"
            "routes:\n"
            "  - name: blue\n"
            "    match: {path_prefix: /orders, headers: {host: blue.example}}\n"
            f'    upstream: "http://127.0.0.1:{blue.port}"\n'
            "  - name: green\n"
            "    match: {path_prefix: /orders, headers: {host: green.example}}\n"
            f'    upstream: "http://127.0.0.1:{green.port}"\n'
        )
        port, admin = await start(proc_stack, tmp_path, body)
        url = f"http://127.0.0.1:{port}/orders"
        for host, app in (("blue.example", blue), ("green.example", green)):
            for n in range(2):
                headers = {"Host": host, "Idempotency-Key": "order-1"}
                status, got, _ = await call("POST", url, data=b'{"amount":1}', headers=headers)
                assert status == 201 and ("Idempotent-Replayed" in got) == (n == 1), (host, n)
            assert got["X-App"] == "yes" and len(app.writes) == 1, host
        status, _, shown = await call("GET", f"http://127.0.0.1:{admin}/idempotency/order-1")
        assert status == 200
        held = json.loads(shown)["scopes"]
        assert sorted((s["route"], s["scope"]) for s in held) == [("blue", "-"), ("green", "-")]
        status, _, _ = await call("DELETE", f"http://127.0.0.1:{admin}/idempotency/order-1")
        assert status == 409  # two hold it: the route must be named
        forget = f"http://127.0.0.1:{admin}/idempotency/order-1?route=green"
        status, _, gone = await call("DELETE", forget)
        assert status == 200 and json.loads(gone)["route"] == "green"


async def test_concurrent_big_answers_keep_the_file_within_max_bytes(
    tmp_path: Path, proc_stack: list[SidecarProcess]
) -> None:
    """Issue 29 F1: ``max_bytes`` was checked at claim time only, so concurrent writes all
    claimed in a nearly empty file, then all kept their answers (40 answers of 900 KB under
    1 MiB: 36 MB). Now an answer that would pass the bound is kept without its body: each
    client gets its whole answer, the file stays within the bound (plus one key's head), every
    key is finished (the write never runs again: a duplicate gets the kept answer, or the
    original status with ``answer-not-kept``), counted ``store-full``."""
    gate, entered, runs = asyncio.Event(), [0], [0]
    big = b"x" * 20_000

    async def handle(request: web.Request) -> web.StreamResponse:
        await request.read()
        entered[0] += 1
        await gate.wait()
        runs[0] += 1
        return web.Response(body=big, status=201, content_type="text/plain")

    bound = 64 * 1024
    async with serve(handle) as app_port:
        body = (
            f'idempotency: {{path: "{tmp_path}/keys.sqlite3", max_bytes: {bound}}}\n'
            "routes:\n  - name: orders\n"
            f'    upstream: "http://127.0.0.1:{app_port}"\n'
            "    idempotency: {enabled: true}\n"
        )
        port, admin = await start(proc_stack, tmp_path, body)
        writes = [asyncio.create_task(post(port, key=f"w{i}")) for i in range(10)]
        await until(lambda: entered[0] == 10, "all ten claimed before any answer")
        gate.set()
        for status, _, got in await asyncio.gather(*writes):
            assert (status, got) == (201, big)
        conn = sqlite3.connect(tmp_path / "keys.sqlite3")
        try:
            records, size = conn.execute("SELECT records, bytes FROM idempotency_tally").fetchone()
            whole = conn.execute(
                "SELECT COUNT(*) FROM idempotency_keys WHERE finished = 1 AND body IS NOT NULL"
            ).fetchone()[0]
            finished = conn.execute(
                "SELECT COUNT(*) FROM idempotency_keys WHERE finished = 1"
            ).fetchone()[0]
        finally:
            conn.close()
        assert size <= bound, (size, whole)
        assert (records, finished) == (10, 10) and 1 <= whole < 10
        not_kept = 0
        for i in range(10):
            status, headers, got = await post(port, key=f"w{i}")
            assert (status, headers["Idempotent-Replayed"]) == (201, "true")
            if got != big:
                problem(got, "answer-not-kept")
                not_kept += 1
        assert (not_kept, runs[0]) == (10 - whole, 10)
        seen = await counts(admin)
        assert (seen["store-full"], seen["first"], seen["replayed"]) == (10 - whole, whole, 10)

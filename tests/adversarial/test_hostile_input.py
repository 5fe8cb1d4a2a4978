"""Hostile input: config files, admin API calls and per-request headers built to break the
sidecar. Each must get a clear error (a config line naming the key path, a 4xx with
``{"error": ...}``), never a traceback, a hang or a dead background task."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from sidecar.config.errors import ConfigError
from sidecar.config.model import Config
from sidecar.config.parse import parse_text
from tests.conftest import Running, Upstream, reply, routes_yaml
from tests.wait import BOUND, until

BASE = """version: 1
listen: "127.0.0.1:0"
routes:
  - name: main
    upstream: "http://127.0.0.1:1"
"""
HUGE_INT = "9" * 5000  # over Python's 4300-digit limit for int(str)
HUGE_FLOAT_DIGITS = "9" * 400  # float() of it is inf


@pytest.mark.parametrize(
    ("text", "wanted"),
    [
        (BASE + f"    retry: {{attempts: {HUGE_INT}}}\n", "routes[0].retry.attempts"),
        (BASE + f"limits: {{max_request_body: {HUGE_INT}}}\n", "limits.max_request_body"),
        (BASE + f"limits: {{max_request_body: '{HUGE_INT}KiB'}}\n", "limits.max_request_body"),
        (BASE + f"    timeout: '{HUGE_FLOAT_DIGITS}s'\n", "routes[0].timeout"),
        (BASE + f"drain_timeout: '{HUGE_FLOAT_DIGITS}ms'\n", "drain_timeout"),
        (BASE + "    budget: {min_per_second: 1.0e+308}\n", "routes[0].budget.min_per_second"),
        (BASE + f"    budget: {{min_per_second: 1{'0' * 400}}}\n", "budget.min_per_second"),
        (BASE + "    x: 2001-13-45\n", "routes[0].x"),
        (BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n", "nest"),
        (BASE + "x: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nest"),
        (BASE + "x:\n" + "".join("  " * i + "- \n" for i in range(1, 400)), "nest"),
    ],
    ids=[
        "huge-int",
        "huge-size",
        "huge-size-string",
        "infinite-duration",
        "infinite-drain",
        "absurd-rate",
        "400-digit-rate",
        "bad-timestamp",
        "deep-lists",
        "deep-maps",
        "deep-block-lists",
    ],
)
def test_hostile_values_are_config_errors_naming_the_key(text: str, wanted: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_text(text, "c.yaml")
    lines = info.value.lines()
    assert all(line.startswith("c.yaml:") for line in lines), lines
    assert any(wanted in line for line in lines), lines


async def watched_sidecar(
    upstream_factory: Any, sidecar_factory: Any, tmp_path: Path
) -> tuple[Upstream, Running, Path]:
    """An in-process sidecar watching its config file (``retry: {attempts: 2}``) every 50 ms:
    the upstream, the sidecar and the file."""
    up = await upstream_factory(reply(200))
    cfg = tmp_path / "sidecar.yaml"
    good = routes_yaml(up.url, "    retry: {attempts: 2}")
    cfg.write_text(good)
    return up, await sidecar_factory(good, config_path=str(cfg), watch_interval=0.05), cfg


async def the_watcher_loads_the_next_edit(up: Upstream, sc: Running, cfg: Path) -> None:
    """The watcher is still alive: a good edit (``attempts: 3``) is loaded unasked."""
    cfg.write_text(routes_yaml(up.url, "    retry: {attempts: 3}"))
    await until(
        lambda: sc.sidecar.store.current.route("main").retry.attempts == 3,  # type: ignore[union-attr]
        "the next edit to be loaded by the watcher",
    )


async def test_a_hostile_file_on_hot_reload_keeps_the_watcher_and_the_old_config(
    upstream_factory, sidecar_factory, client, tmp_path: Path
) -> None:
    """A file the parser could not turn into a config error (a 5,000-digit integer) killed the
    file watcher: no later edit was ever loaded, and the admin reload answered 500."""
    up, sc, cfg = await watched_sidecar(upstream_factory, sidecar_factory, tmp_path)
    version = sc.sidecar.store.current.sha256
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    cfg.write_text(routes_yaml(up.url, f"    retry: {{attempts: {HUGE_INT}}}"))
    await until(lambda: sc.sidecar.store.last_error is not None, "the bad file to be seen")
    assert "routes[0].retry.attempts" in (sc.sidecar.store.last_error or "")
    async with client.post(admin + "/config/reload") as resp:
        assert resp.status == 422
        assert any("routes[0].retry.attempts" in e for e in (await resp.json())["errors"])
    assert sc.sidecar.store.current.sha256 == version
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200
    # The watcher is still alive: a good edit is loaded without anyone asking.
    await the_watcher_loads_the_next_edit(up, sc, cfg)


async def test_a_parser_bug_on_hot_reload_refuses_the_file_and_keeps_the_watcher(
    upstream_factory, sidecar_factory, client, tmp_path: Path, monkeypatch
) -> None:
    """Whatever input the parser has not yet learnt to turn into a config error (the test
    stands in one with a patched parser that raises): the reload is refused like a bad file,
    the admin reload answers 422 not 500, and the watcher lives on to load the next edit."""
    from sidecar.config import watch
    from sidecar.config.parse import parse_bytes

    up, sc, cfg = await watched_sidecar(upstream_factory, sidecar_factory, tmp_path)
    version = sc.sidecar.store.current.sha256
    real = parse_bytes

    def buggy(raw: bytes, path: str) -> object:
        if b"attempts: 4" in raw:
            raise KeyError("a parser bug")
        return real(raw, path)

    monkeypatch.setattr(watch, "parse_bytes", buggy)
    cfg.write_text(routes_yaml(up.url, "    retry: {attempts: 4}"))
    await until(lambda: sc.sidecar.store.last_error is not None, "the refusal to be seen")
    assert "the parser failed: KeyError" in (sc.sidecar.store.last_error or "")
    async with client.post(f"http://127.0.0.1:{sc.sidecar.admin_port}/config/reload") as resp:
        assert resp.status == 422
    assert sc.sidecar.store.current.sha256 == version
    await the_watcher_loads_the_next_edit(up, sc, cfg)


async def test_a_failure_applying_a_config_does_not_end_the_watcher(
    upstream_factory, sidecar_factory, tmp_path: Path
) -> None:
    """A bug while a parsed config is applied (stood in by an apply that raises once) ended
    the watcher task: no later edit was loaded until a restart. It is logged, and the next
    edit is loaded."""
    up, sc, cfg = await watched_sidecar(upstream_factory, sidecar_factory, tmp_path)
    reloader = sc.sidecar.reloader
    assert reloader is not None
    real = reloader._apply
    failed: list[int] = []

    def apply(new: Config) -> None:
        if new.route("main").retry.attempts == 4 and not failed:  # type: ignore[union-attr]
            failed.append(4)
            raise RuntimeError("a bug applying the config")
        real(new)

    reloader._apply = apply  # type: ignore[method-assign]
    cfg.write_text(routes_yaml(up.url, "    retry: {attempts: 4}"))
    await until(lambda: failed == [4], "the failed apply")
    await the_watcher_loads_the_next_edit(up, sc, cfg)
    assert "config-watch" in sc.sidecar.task_names()


def _release_fifo(path: Path) -> None:
    """Open the FIFO's write end once, so that a reader blocked in open() (the old code) gets
    end-of-file instead of holding a thread forever."""
    with contextlib.suppress(OSError):  # ENXIO: nobody is blocked on it
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))


@pytest.mark.parametrize("kind", ["fifo", "directory", "too-large", "not-utf8"])
async def test_a_config_path_that_is_no_readable_file_is_refused_at_once(
    upstream_factory, sidecar_factory, tmp_path: Path, kind: str
) -> None:
    """The config file replaced by a FIFO, a directory, a file over 1 MiB or bytes that are not
    UTF-8: POST /config/reload answers 422 with the reason and the old config keeps serving.
    A FIFO blocked the reload thread in open() forever (and the reload lock with it: every
    later reload hung too)."""
    up = await upstream_factory(reply(200))
    cfg = tmp_path / "sidecar.yaml"
    good = routes_yaml(up.url)
    cfg.write_text(good)
    # The watcher stays out of the way: the admin reload is what is tested.
    sc = await sidecar_factory(good, config_path=str(cfg), watch_interval=3600.0)
    version = sc.sidecar.store.current.sha256
    cfg.unlink()
    if kind == "fifo":
        os.mkfifo(cfg)
        wanted = "not a regular file"
    elif kind == "directory":
        cfg.mkdir()
        wanted = "cannot read"
    elif kind == "too-large":
        with open(cfg, "wb") as f:
            f.truncate(64 * 1024 * 1024)  # sparse: no disk used
        wanted = "larger than"
    else:
        cfg.write_bytes(good.encode() + b"# \xff\xfe\n")
        wanted = "not UTF-8"
    admin = f"http://127.0.0.1:{sc.sidecar.admin_port}"
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as s:
            for _ in range(2):  # the second one shows the reload lock was given back
                async with s.post(admin + "/config/reload") as resp:
                    assert resp.status == 422
                    body = await resp.json()
                    assert any(wanted in e for e in body["errors"]), body
                    assert body["version"] == version
            async with s.get(sc.url + "/x") as resp:
                assert resp.status == 200
    finally:
        if kind == "fifo":
            _release_fifo(cfg)


def test_validate_refuses_a_fifo_instead_of_waiting_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "sidecar.yaml"
    os.mkfifo(fifo)
    try:
        out = subprocess.run(
            [sys.executable, "-m", "sidecar", "validate", str(fifo)],
            capture_output=True,
            text=True,
            timeout=BOUND * 2,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
    finally:
        _release_fifo(fifo)
    assert out.returncode == 1
    assert out.stdout.startswith(f"{fifo}:0: <file>: ") and "not a regular file" in out.stdout
    assert "Traceback" not in out.stderr


ADMIN_TOKEN = "s3cret-token"
AUTH = b"Authorization: Bearer " + ADMIN_TOKEN.encode() + b"\r\n"
FORM = b"Content-Type: application/x-www-form-urlencoded\r\n"
DEEP_JSON = b"[" * 60_000  # within the 64 KiB admin body limit
JSON_TYPE = b"Content-Type: application/json\r\n"


def _request(method: str, target: str, headers: bytes = b"", body: bytes = b"") -> bytes:
    return (
        f"{method} {target} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode()
        + headers
        + b"Content-Length: %d\r\n\r\n" % len(body)
        + body
    )


@pytest.mark.parametrize(
    ("method", "target", "headers", "body", "status"),
    [
        ("PUT", "/killswitch", AUTH + JSON_TYPE, DEEP_JSON, 400),
        ("POST", "/dlq/replay", AUTH + JSON_TYPE, DEEP_JSON, 400),
        ("PUT", "/killswitch", b"Authorization: Bearer \xff\r\n", b"{}", 401),
        ("PUT", "/killswitch", b"Authorization: Bearer \xc3\xa9\r\n", b"{}", 401),
        ("GET", "/dlq?limit=%C2%B2", AUTH, b"", 400),  # "²".isdigit() is true
        ("GET", f"/dlq?limit={HUGE_INT}", AUTH, b"", 400),
        ("GET", "/dlq?cursor=%C2%B2", AUTH, b"", 400),
        ("GET", f"/dlq?cursor={'9' * 30}", AUTH, b"", 400),  # over SQLite's integers
        ("GET", f"/dlq?cursor={HUGE_INT}", AUTH, b"", 400),
        ("GET", "/?refresh=%C2%B2", b"", b"", 200),  # the status page is lenient
        ("GET", f"/?refresh={HUGE_INT}", b"", b"", 200),
        ("GET", "/?done=%C2%B2", b"", b"", 200),
        ("GET", f"/?done={HUGE_INT}", b"", b"", 200),
        ("POST", "/ui/killswitch", FORM, b"nonce=1.x.%C3%A9&token=s3cret-token", 403),
        ("POST", "/ui/dlq/replay", FORM, b"\xff", 400),  # a form body that is not UTF-8
    ],
    ids=[
        "killswitch-deep-json",
        "replay-deep-json",
        "token-not-utf8",
        "token-not-ascii",
        "dlq-limit-superscript",
        "dlq-limit-huge",
        "dlq-cursor-superscript",
        "dlq-cursor-over-int64",
        "dlq-cursor-huge",
        "page-refresh-superscript",
        "page-refresh-huge",
        "page-done-superscript",
        "page-done-huge",
        "form-nonce-not-ascii",
        "form-body-not-utf8",
    ],
)
async def test_hostile_admin_calls_get_a_clear_answer_never_a_500(
    upstream_factory,
    sidecar_factory,
    monkeypatch,
    tmp_path: Path,
    method: str,
    target: str,
    headers: bytes,
    body: bytes,
    status: int,
) -> None:
    from tests.rawhttp import raw_request

    monkeypatch.setenv("TEST_ADMIN_TOKEN", ADMIN_TOKEN)
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url,
            "    dlq: {enabled: true}",
            top_extra=f'dlq: {{path: "{tmp_path}/dlq.sqlite3"}}',
            admin='admin: {listen: "127.0.0.1:0", token_env: TEST_ADMIN_TOKEN}',
        )
    )
    out = await raw_request(sc.sidecar.admin_port, _request(method, target, headers, body))
    head, _, payload = out.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 %d %s" % (
        status,
        {200: b"OK", 400: b"Bad Request", 401: b"Unauthorized", 403: b"Forbidden"}[status],
    ), out[:300]
    if status != 200 and b"application/json" in head:
        assert set(json.loads(payload)) >= {"error"}


async def test_the_bearer_scheme_is_case_insensitive(
    upstream_factory, sidecar_factory, monkeypatch
) -> None:
    """RFC 9110 section 11.1: the authentication scheme is a case-insensitive token."""
    from tests.rawhttp import raw_request

    monkeypatch.setenv("TEST_ADMIN_TOKEN", ADMIN_TOKEN)
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(
        routes_yaml(up.url, admin='admin: {listen: "127.0.0.1:0", token_env: TEST_ADMIN_TOKEN}')
    )
    body = json.dumps({"scope": "global", "ttl": "1m", "reason": "x"}).encode()
    for scheme in (b"bearer", b"BEARER"):
        auth = b"Authorization: " + scheme + b" " + ADMIN_TOKEN.encode() + b"\r\n" + JSON_TYPE
        out = await raw_request(sc.sidecar.admin_port, _request("PUT", "/killswitch", auth, body))
        assert out.startswith(b"HTTP/1.1 200 OK"), out[:200]
    wrong = b"Authorization: Basic " + ADMIN_TOKEN.encode() + b"\r\n"
    out = await raw_request(sc.sidecar.admin_port, _request("PUT", "/killswitch", wrong, body))
    assert out.startswith(b"HTTP/1.1 401"), out[:200]


async def test_a_malformed_chunk_mid_body_is_a_400_at_once_and_the_upstream_is_cut(
    sidecar_factory,
) -> None:
    """A chunk size that is not hex, after a streamed upload began: aiohttp's parser fails
    the connection but not the body being read, so the body read waited out
    body_idle_timeout and the client got a 408 (counted body-timeout) while the half-sent
    upload held its upstream connection. nginx answers 400 at once ("client sent invalid
    chunked body"). The upstream connection is cut, and the upload is not resent."""
    from tests.rawhttp import raw_server, read_head

    body_started = asyncio.Event()
    upstream_saw_eof = asyncio.Event()
    connections = 0

    async def upstream(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        await read_head(r)
        while await r.read(65536):
            body_started.set()
        upstream_saw_eof.set()

    async with raw_server(upstream) as port:
        sc = await sidecar_factory(
            routes_yaml(
                f"http://127.0.0.1:{port}",
                "    retry: {max_body_bytes: 1KiB, non_idempotent: always}",
                # The idle timeout is far beyond the wait below: only an at-once answer passes.
                top_extra="limits: {body_idle_timeout: 600s}",
            )
        )
        r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
        try:
            w.write(b"POST /up HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
            w.write(b"1000\r\n" + b"a" * 4096 + b"\r\n")  # over max_body_bytes: streamed
            await w.drain()
            await asyncio.wait_for(body_started.wait(), BOUND)
            w.write(b"zz-not-hex\r\nboom\r\n")
            await w.drain()
            head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), BOUND)
        finally:
            w.close()
        assert head.startswith(b"HTTP/1.1 400 "), head
        await asyncio.wait_for(upstream_saw_eof.wait(), BOUND)
        assert connections == 1  # never resent
        text = sc.sidecar.metrics.render()
        assert 'retry_sidecar_malformed_requests_total{reason="malformed"} 1' in text
        assert "body-timeout" not in text


async def test_a_backtracking_path_regex_cannot_freeze_the_process(
    upstream_factory, tmp_path: Path
) -> None:
    """``/(a+)+b`` against ``/aaaa...a``: Python's re tries every way to split the a's (2^n
    steps: 26 of them froze the event loop 2 s, 40 for hours: every request and /healthz
    stalled). path_regex is matched with RE2, whose time is linear in the path, as Envoy's
    safe_regex is."""
    from tests.proc import SidecarProcess, free_port

    up = await upstream_factory(reply(200, b"the other route"))
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(f"""version: 1
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
routes:
  - name: evil
    match: {{path_regex: "/(a+)+b"}}
    upstream: "http://127.0.0.1:1"
  - name: rest
    upstream: "{up.url}"
""")
    proc = SidecarProcess(cfg)
    proc.start()
    try:
        await proc.wait_port(port, admin)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=BOUND)) as s:
            async with s.get(f"http://127.0.0.1:{port}/" + "a" * 64) as resp:
                assert resp.status == 200
                assert await resp.read() == b"the other route"
            async with s.get(f"http://127.0.0.1:{port}/aaab") as resp:
                assert resp.headers["x-retry-proxy-error"] == "connect-failure"  # evil matched
            async with s.get(f"http://127.0.0.1:{admin}/healthz") as resp:
                assert resp.status == 200
    finally:
        proc.terminate(timeout=5)  # the old code's loop never gets to the signal: killed


async def test_a_malformed_chunk_after_the_answer_was_sent_logs_no_traceback(
    sidecar_factory, caplog
) -> None:
    """The sidecar answered before reading the body (no route matches) and the client goes on
    sending it, then breaks its chunked framing: aiohttp reads the rest of the body away after
    the answer, and the malformed chunk must not fail that read (aiohttp logged it as an
    "Unhandled exception" with a traceback). The connection just ends, as before."""
    sc = await sidecar_factory(routes_yaml("http://127.0.0.1:9", "    match: {path_prefix: /only}"))
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    try:
        w.write(
            b"POST /elsewhere HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"5\r\nhello\r\n"
        )
        await w.drain()
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), BOUND)
        assert head.startswith(b"HTTP/1.1 404 ")
        # The client's FIN right behind it: the connection ends at once (not after aiohttp's
        # 10 s of lingering), and only after the malformed chunk was read.
        w.write(b"zz-not-hex\r\nboom\r\n")
        w.write_eof()
        rest = await asyncio.wait_for(r.read(), BOUND)  # until the connection ends
    finally:
        w.close()
    assert rest == b'{"error": "no route matches POST /elsewhere"}'  # the 404's body, no more
    assert "Unhandled exception" not in caplog.text
    assert "Traceback" not in caplog.text


@pytest.mark.parametrize("values", [("200", "5000"), ("5000", "200"), ("5000, 200",)])
async def test_a_repeated_propagated_deadline_takes_the_smallest(
    upstream_factory, sidecar_factory, values: tuple[str, ...]
) -> None:
    """``x-request-timeout-ms`` sent twice (or as a comma list) by a trusted peer: each value is
    a bound some caller set, so the smallest holds. The last line won before (and a comma list
    was ignored): the 200 ms bound was lost whenever it came first."""
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url, "    timeout: 10s"))
    r, w = await asyncio.open_connection("127.0.0.1", sc.sidecar.proxy_port)
    try:
        lines = b"".join(b"x-request-timeout-ms: %s\r\n" % v.encode() for v in values)
        w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n" + lines + b"\r\n")
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), BOUND)
    finally:
        w.close()
    assert head.startswith(b"HTTP/1.1 200 ")
    [sent] = up.seen[0].all("x-request-timeout-ms")  # what the sidecar passed on upstream
    assert 0 < int(sent) <= 200

"""The user-facing names checked from outside: the real ``python -m sidecar`` process and CLI,
real upstreams on loopback. Each test here pins a place where the running product and its
documentation (docs/, the example config) disagreed."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
from aiohttp import web

from tests.proc import free_port, start_process
from tests.wait import until
from tests.webserver import serve

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "config" / "sidecar.yaml"
HEADERS_PAGE = (ROOT / "docs" / "headers.md").read_text()

# One unknown key in every section the validator knows: its error lists the keys allowed there.
PROBE = """version: 1
bogus_key: 1
admin: {bogus_key: 1}
dlq: {bogus_key: 1}
limits: {bogus_key: 1}
upstream_pool: {bogus_key: 1}
defaults:
  bogus_key: 1
  retry:
    bogus_key: 1
    auto_timeout: {bogus_key: 1}
    backoff: {bogus_key: 1}
    retry_after: {bogus_key: 1}
  breaker: {bogus_key: 1}
  budget: {bogus_key: 1}
  throttle: {bogus_key: 1}
  hedge: {bogus_key: 1}
  bulkhead: {bogus_key: 1}
  dlq: {bogus_key: 1, redrive: {bogus_key: 1}}
killswitches:
  - {scope: global, reason: x, until: "2099-01-01T00:00:00Z", bogus_key: 1}
routes:
  - name: a
    upstream: "http://127.0.0.1:1"
    bogus_key: 1
    match: {bogus_key: 1}
"""


def test_the_example_config_shows_every_key_validate_accepts(tmp_path: Path) -> None:
    """docs/configuration.md: "The example config/sidecar.yaml is a working config with every key
    written out". The keys
    are taken from what ``retry-sidecar validate`` itself says is allowed in each section."""
    probe = tmp_path / "probe.yaml"
    probe.write_text(PROBE)
    res = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(probe)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr
    allowed: dict[str, list[str]] = {}
    for line in (res.stdout + res.stderr).splitlines():
        m = re.match(r".*:\d+: (\S*?)\.?bogus_key: unknown key \(allowed: (.*)\)$", line)
        if m:
            allowed[m.group(1) or "<top>"] = m.group(2).split(", ")
    assert len(allowed) == PROBE.count("bogus_key"), res.stdout + res.stderr
    example = EXAMPLE.read_text()
    missing = {
        f"{section}.{key}"
        for section, keys in allowed.items()
        for key in keys
        if not re.search(rf"(^|[\s{{,#-]){re.escape(key)}:", example, re.M)
    }
    assert missing == set()
    # And the example itself is valid.
    ok = subprocess.run(
        [sys.executable, "-m", "sidecar", "validate", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("OK: "), ok.stdout + ok.stderr


def _proxy_error_codes_in_docs() -> set[str]:
    """The x-retry-proxy-error codes the headers page (docs/headers.md) lists."""
    start = HEADERS_PAGE.index("- `x-retry-proxy-error: <code>` when the sidecar made the response")
    end = HEADERS_PAGE.index("- Every response the sidecar made itself also carries")
    return set(re.findall(r"`([a-z][a-z-]+)`", HEADERS_PAGE[start:end]))


async def test_a_kill_switch_set_during_a_backoff_answers_with_a_documented_error(
    tmp_path: Path,
) -> None:
    """A retry scheduled before an SRE flips the kill switch is not sent (nor counted in
    retries_total or the retry budget); the client gets the sidecar's own 503. Its x-retry-proxy-error code must be one docs/headers.md documents, its
    Proxy-Status must not claim a broken connection (the upstream answered, with a 503), and
    RFC 9209's ``received-status`` says what the upstream answered."""
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.path)
        return web.Response(status=503, text="down")

    async with serve(handle) as up_port:
        sc, port, admin = await start_process(
            tmp_path,
            f"""routes:
  - name: main
    upstream: "http://127.0.0.1:{up_port}"
    timeout: 5m
    retry: {{attempts: 3, backoff: {{strategy: constant, base: 60s, max: 60s}}}}
""",
        )
        try:
            async with aiohttp.ClientSession() as client:
                pending = asyncio.create_task(client.get(f"http://127.0.0.1:{port}/x"))
                await until(lambda: len(seen) == 1, "the first attempt")
                # Its answer has been judged once the attempt is counted: the sequence then sleeps
                # out its 60 s backoff (nothing is awaited between the two).
                judged = False

                async def attempt_counted() -> None:
                    nonlocal judged
                    async with client.get(f"http://127.0.0.1:{admin}/metrics") as m:
                        judged = (
                            'retry_sidecar_attempts_total{route="main",outcome="503"} 1'
                            in await m.text()
                        )

                for _ in range(1500):
                    await asyncio.wait_for(attempt_counted(), 15)
                    if judged:
                        break
                    await asyncio.sleep(0.01)
                assert judged, "the first attempt was never counted"
                async with client.put(
                    f"http://127.0.0.1:{admin}/killswitch",
                    json={"scope": "route:main", "ttl": "15m", "reason": "INC-1"},
                ) as r:
                    assert r.status == 200
                resp = await asyncio.wait_for(pending, 30)
                body = await resp.json()
                resp.release()
            assert seen == ["/x"]  # the scheduled retry was not sent
            assert resp.status == 503
            assert resp.headers["x-retry-fate"] == "kill-switch"
            code = resp.headers["x-retry-proxy-error"]
            assert code == "kill-switch"
            assert code in _proxy_error_codes_in_docs()
            assert resp.headers["Proxy-Status"] == (
                "retry-sidecar; error=destination_unavailable; received-status=503"
            )
            assert body["fate"] == "kill-switch" and body["attempts"] == 1
            assert "kill switch" in body["error"]
            # The retry never went out: not counted, and its retry-budget token was given back.
            async with aiohttp.ClientSession() as client:
                async with client.get(f"http://127.0.0.1:{admin}/metrics") as m:
                    assert 'retry_sidecar_retries_total{route="main"} 1' not in await m.text()
                async with client.get(f"http://127.0.0.1:{admin}/status") as st:
                    [route] = (await st.json())["routes"]
                    assert route["budget_retries"] == 0
        finally:
            sc.terminate()


async def test_a_backoff_sleep_wakes_only_for_a_switch_that_covers_its_route() -> None:
    """The kill switch nudges every backoff sleep; one whose route the switch does not cover
    sleeps on, and a sleep cancelled half-way (the client left) leaves no sleeper behind."""
    import random

    from sidecar.admin.killswitch import KillSwitch
    from sidecar.config.parse import parse_text
    from sidecar.core import Clock
    from sidecar.engine.gate import SequenceGate
    from sidecar.engine.routestate import RouteStates
    from sidecar.lifecycle import Lifecycle

    config = parse_text(
        "version: 1\nroutes:\n"
        "  - {name: a, upstream: 'http://127.0.0.1:1', match: {path_prefix: /a}}\n"
        "  - {name: b, upstream: 'http://127.0.0.1:1'}\n"
    )
    states = RouteStates()
    states.sync(config)
    kill, life, clock = KillSwitch(), Lifecycle(), Clock()
    kill.on_set(life.nudge_sleepers)
    gates = {
        name: SequenceGate(name, states.get(name), kill, life, clock, random.Random(1))
        for name in ("a", "b")
    }
    sleep_a = asyncio.create_task(gates["a"].sleep(300.0))
    sleep_b = asyncio.create_task(gates["b"].sleep(300.0))
    await until(lambda: len(life._sleepers) == 2, "both sleeps")
    kill.set("route:b", 60.0, "INC-1", "test", clock.monotonic(), clock.wall())
    await asyncio.wait_for(sleep_b, 15)  # b's retry will not be sent: its wait ends
    await until(lambda: len(life._sleepers) == 1, "a sleeping again")
    assert not sleep_a.done()  # a is not covered: it sleeps the rest of its delay
    sleep_a.cancel()
    await asyncio.gather(sleep_a, return_exceptions=True)
    assert life._sleepers == set()


def _series(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def test_every_known_series_is_scraped_at_zero_before_any_traffic(tmp_path: Path) -> None:
    """Prometheus' own advice ("avoid missing metrics"): a counter whose label values are known
    in advance is exported at 0 from the start. A series that first appears at 1 is invisible
    to ``increase()``/``rate()`` (nothing before it to compare with), so the chart's
    DLQ-write alert missed the first failed write of a pod, and a route whose every request
    failed since the start showed no success ratio (no ``fate="success"`` series) instead of
    0 %. Checked on the real process's first scrape, with promtool when it is installed."""
    sc, _port, admin = await start_process(
        tmp_path,
        f"""dlq: {{path: "{tmp_path / "dlq.sqlite3"}"}}
routes:
  - name: orders
    match: {{path_prefix: /orders}}
    upstream: "http://127.0.0.1:1"
    dlq: {{enabled: true}}
  - name: default
    upstream: "http://127.0.0.1:1"
""",
    )
    try:
        async with (
            aiohttp.ClientSession() as client,
            client.get(f"http://127.0.0.1:{admin}/metrics") as resp,
        ):
            text = await resp.text()
    finally:
        sc.terminate()
    series = _series(text)
    p = "retry_sidecar_"
    # The x-retry-fate values, and the headers page's additions: throttled, overloaded, draining, and
    # the two never sent in a header, client-gone and body-broken.
    fates = [
        "success",
        "exhausted",
        "not-retryable",
        "non-idempotent",
        "body-too-large",
        "budget-exhausted",
        "breaker-open",
        "kill-switch",
        "deadline",
        "edge-owned",
        "retry-after-too-long",
        "throttled",
        "overloaded",
        "draining",
        "client-gone",
        "body-broken",
    ]
    expected = []
    for route in ("orders", "default"):
        expected += [f'{p}requests_total{{route="{route}",fate="{f}"}}' for f in fates]
        expected += [f'{p}retries_total{{route="{route}"}}']
        expected += [f'{p}retry_budget_exhausted_total{{route="{route}"}}']
        expected += [
            f'{p}breaker_transitions_total{{route="{route}",to="{to}"}}'
            for to in ("closed", "half-open", "open")
        ]
    expected += [
        f'{p}dlq_writes_total{{route="orders",result="{r}"}}'
        for r in ("stored", "full", "unavailable", "body-too-large")
    ]
    assert {s: series.get(s) for s in expected} == dict.fromkeys(expected, 0.0)
    # A route without the DLQ has no DLQ writes to count.
    assert not [s for s in series if s.startswith(f'{p}dlq_writes_total{{route="default"')]
    import shutil

    promtool = shutil.which("promtool")
    if promtool:
        check = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
        )
        assert check.returncode == 0, check.stdout + check.stderr


async def test_a_pool_wait_ended_by_the_per_try_timeout_is_not_called_a_deadline(
    tmp_path: Path,
) -> None:
    """A wait for a pooled connection that the attempt's per-try timeout ends is no time left
    for that attempt; with the sequence's deadline far off, the sidecar's 504 must say
    ``per-try-timeout`` (the headers page's code for it), not ``deadline`` with "the request deadline
    passed", which sends an SRE after the wrong timeout."""
    seen: list[str] = []
    release = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        seen.append(request.path)
        if request.path == "/hold":
            await release.wait()
        return web.Response(text="ok")

    async with serve(handle) as up_port:
        up = f"http://127.0.0.1:{up_port}"
        sc, port, _admin = await start_process(
            tmp_path,
            f"""upstream_pool: {{max_connections: 1, wait_timeout: 60s}}
defaults:
  timeout: 5m
  retry: {{attempts: 2, per_try_timeout: 300ms, backoff: {{strategy: constant, base: 1ms, max: 1ms}}}}
  hedge: {{enabled: false}}
routes:
  - name: hold
    match: {{path: /hold}}
    upstream: "{up}"
    retry: {{per_try_timeout: 5m}}
  - name: main
    upstream: "{up}"
""",
        )
        try:
            async with aiohttp.ClientSession() as client:
                holding = asyncio.create_task(client.get(f"http://127.0.0.1:{port}/hold"))
                await until(lambda: seen == ["/hold"], "the one pooled connection to be busy")
                async with client.get(f"http://127.0.0.1:{port}/x") as resp:
                    body = await resp.json()
                    status, headers = resp.status, resp.headers
                release.set()
                (await holding).release()
        finally:
            sc.terminate()
    assert seen == ["/hold"]  # /x never got a connection
    assert status == 504
    assert headers["x-retry-fate"] == "exhausted"
    assert headers["x-retry-proxy-error"] == "per-try-timeout"
    assert headers["Proxy-Status"] == "retry-sidecar; error=http_response_timeout"
    assert body == {
        "error": "the upstream did not answer within the per-try timeout",
        "fate": "exhausted",
        "attempts": 2,
    }


def test_every_admin_verb_reports_an_unreachable_sidecar_in_one_line() -> None:
    """``dlq`` verbs, like ``status``, ``killswitch`` and ``healthcheck``, are typed during an
    incident: a sidecar that does not answer is one line on stderr and exit 1, not a
    traceback."""
    admin = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for argv in (
        ["dlq", "list"],
        ["dlq", "show", "1"],
        ["dlq", "replay", "--dry-run"],
        ["dlq", "purge", "1"],
        ["status"],
        ["killswitch", "list"],
    ):
        res = subprocess.run(
            [sys.executable, "-m", "sidecar", *argv, "--admin", admin],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert res.returncode == 1, argv
        assert res.stdout == "", argv
        assert res.stderr.startswith(f"error: cannot reach the admin API at {admin}"), argv
        assert "Traceback" not in res.stderr, argv


async def test_proxy_status_of_intermediaries_further_down_reaches_the_client(
    tmp_path: Path,
) -> None:
    """RFC 9209: ``Proxy-Status`` is an end-to-end list, one member per intermediary that
    handled the response, closest to the origin first; it is not hop-by-hop like
    ``Proxy-Connection`` or ``Proxy-Authenticate``. The sidecar dropped it with every
    ``Proxy-*`` field, so a 503 that an inner sidecar (or Envoy) made itself reached the
    client with no trace of who made it. nginx and Envoy pass it on."""
    from tests.rawhttp import canned, raw_request, raw_server

    inner = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n"
        b"Proxy-Status: retry-sidecar; error=destination_unavailable\r\n"
        b"Proxy-Authenticate: Basic realm=x\r\n"
        b"x-retry-proxy-error: breaker-open\r\n\r\ndown"
    )
    async with raw_server(canned(inner)) as up_port:
        sc, port, _admin = await start_process(
            tmp_path,
            f"""routes:
  - name: main
    upstream: "http://127.0.0.1:{up_port}"
""",
        )
        try:
            out = await raw_request(
                port, b"GET /x HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n"
            )
        finally:
            sc.terminate()
    head = out.split(b"\r\n\r\n", 1)[0].lower()
    assert head.startswith(b"http/1.1 503")
    assert b"\r\nproxy-status: retry-sidecar; error=destination_unavailable" in head
    assert b"proxy-authenticate" not in head  # hop-by-hop: for the next client only
    # The sidecar further down refused: relayed as such, once, with this sidecar's fate.
    assert b"x-retry-fate: breaker-open" in head and b"x-retry-attempts: 1" in head


async def test_an_admin_path_called_with_the_wrong_method_answers_405_with_allow(
    tmp_path: Path,
) -> None:
    """``curl :15000/config/reload`` (GET, where POST is meant) answered 404 "no admin
    endpoint", as if reload did not exist. RFC 9110 section 15.5.6: a method the resource
    does not support is 405, with an Allow header naming the ones it does; a path that does
    not exist stays 404. Errors keep their ``{"error": ...}`` shape."""
    seen: dict[tuple[str, str], tuple[int, str | None, dict[str, str]]] = {}
    sc, _port, admin = await start_process(
        tmp_path,
        """routes:
  - name: a
    upstream: "http://127.0.0.1:1"
""",
    )
    try:
        async with aiohttp.ClientSession() as client:
            for method, path in (
                ("GET", "/config/reload"),
                ("POST", "/healthz"),
                ("POST", "/killswitch"),
                ("PATCH", "/dlq/7"),
                ("GET", "/dlq/7/replay"),
                ("GET", "/no/such/thing"),
            ):
                async with client.request(method, f"http://127.0.0.1:{admin}{path}") as r:
                    seen[method, path] = (r.status, r.headers.get("Allow"), await r.json())
    finally:
        sc.terminate()

    def allow(value: str | None) -> set[str]:
        return {m.strip() for m in (value or "").split(",") if m.strip()}

    for key, expected in {
        ("GET", "/config/reload"): {"POST"},
        ("POST", "/healthz"): {"GET"},
        ("POST", "/killswitch"): {"GET", "PUT", "DELETE"},
        ("PATCH", "/dlq/7"): {"GET", "DELETE"},
        ("GET", "/dlq/7/replay"): {"POST"},
    }.items():
        status, allowed, body = seen[key]
        assert (status, allow(allowed) - {"HEAD"}) == (405, expected), key
        assert set(body) == {"error"} and key[0] in body["error"], key
    status, allowed, body = seen["GET", "/no/such/thing"]
    assert (status, allowed, set(body)) == (404, None, {"error"})


async def test_a_client_gone_during_a_backoff_leaves_its_retry_uncounted(
    tmp_path: Path, upstream_factory
) -> None:
    """The real process: the client leaves while its sequence sleeps out a backoff after an
    upstream 503. The retry it waited for is never sent, so it is neither in retries_total nor
    in the retry budget (its token goes back); the request counts as client-gone."""
    from tests.conftest import reply

    up = await upstream_factory(reply(503, b"down"))
    sc, port, admin = await start_process(
        tmp_path,
        f"""routes:
  - name: main
    upstream: "{up.url}"
    timeout: 5m
    retry: {{attempts: 3, backoff: {{strategy: constant, base: 60s, max: 60s}}}}
""",
    )
    try:
        async with aiohttp.ClientSession() as client:

            async def metrics() -> str:
                async with client.get(f"http://127.0.0.1:{admin}/metrics") as m:
                    return await m.text()

            _r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
            await w.drain()
            text = ""
            for _ in range(1500):  # the attempt is counted: the sequence sleeps its backoff
                text = await asyncio.wait_for(metrics(), 15)
                if 'retry_sidecar_attempts_total{route="main",outcome="503"} 1' in text:
                    break
                await asyncio.sleep(0.01)
            assert 'outcome="503"} 1' in text
            w.transport.abort()  # the client leaves during the backoff
            for _ in range(1500):
                text = await asyncio.wait_for(metrics(), 15)
                if 'retry_sidecar_requests_total{route="main",fate="client-gone"} 1' in text:
                    break
                await asyncio.sleep(0.01)
            assert 'fate="client-gone"} 1' in text
            assert 'retry_sidecar_retries_total{route="main"} 1' not in text
            async with client.get(f"http://127.0.0.1:{admin}/status") as st:
                [route] = (await st.json())["routes"]
                assert route["budget_retries"] == 0
        assert len(up.seen) == 1
    finally:
        sc.terminate()

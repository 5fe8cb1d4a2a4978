"""OpenTelemetry spans with the SDK's in-memory exporter: one SERVER span per request, one
CLIENT span per attempt, each attempt's span the parent the upstream sees."""

from __future__ import annotations

import asyncio
import itertools
import random

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sidecar.telemetry.tracing import Tracing
from tests.conftest import reply, routes_yaml

INCOMING = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


async def test_server_and_attempt_spans(upstream_factory, sidecar_factory, client):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    up = await upstream_factory(reply(503), reply(200))
    sc = await sidecar_factory(routes_yaml(up.url), tracing=Tracing(provider))
    async with client.get(sc.url + "/traced", headers={"traceparent": INCOMING}) as resp:
        assert resp.status == 200
    spans = exporter.get_finished_spans()
    server = [s for s in spans if s.kind is SpanKind.SERVER]
    attempts = sorted(
        (s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.start_time or 0
    )
    assert len(server) == 1 and len(attempts) == 2
    srv = server[0]
    # The server span continues the caller's trace.
    assert format(srv.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert srv.parent is not None and format(srv.parent.span_id, "016x") == "b7ad6b7169203331"
    assert srv.name == "GET main"  # {method} {route}
    assert srv.attributes is not None
    assert srv.attributes["http.response.status_code"] == 200
    assert srv.attributes["retry_sidecar.fate"] == "success"
    assert srv.attributes["retry_sidecar.attempts"] == 2
    for a in attempts:
        assert a.parent is not None and a.parent.span_id == srv.context.span_id
        assert a.context.trace_id == srv.context.trace_id
    first, second = attempts
    assert first.attributes is not None and second.attributes is not None
    assert first.attributes["http.response.status_code"] == 503
    assert first.attributes["error.type"] == "503"
    assert first.status.status_code is StatusCode.ERROR
    assert "http.request.resend_count" not in first.attributes
    assert second.attributes["http.request.resend_count"] == 1
    assert second.attributes["http.response.status_code"] == 200
    # What the upstream saw: each attempt's own span as parent.
    sent = [s.header("traceparent") for s in up.seen]
    assert sent == [f"00-{a.context.trace_id:032x}-{a.context.span_id:016x}-01" for a in attempts]


async def test_failed_attempt_has_error_type(sidecar_factory, client, unused_tcp_port):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sc = await sidecar_factory(
        routes_yaml(f"http://127.0.0.1:{unused_tcp_port}", "    retry: {attempts: 1}"),
        tracing=Tracing(provider),
    )
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 502
    [attempt] = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.CLIENT]
    assert attempt.attributes is not None
    assert attempt.attributes["error.type"] == "connect-failure"


async def test_tracing_off_by_default_passes_traceparent_through(
    upstream_factory, sidecar_factory, client, monkeypatch
):
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    assert not Tracing.from_env("x").enabled
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url))
    async with client.get(sc.url + "/x", headers={"traceparent": INCOMING}) as resp:
        assert resp.status == 200
    assert up.seen[0].header("traceparent") == INCOMING


async def test_a_hedge_and_the_adaptive_timeout_are_in_the_spans(
    upstream_factory, sidecar_factory, client
):
    from tests.conftest import hang

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    up = await upstream_factory(hang(5.0), reply(200))
    sc = await sidecar_factory(
        routes_yaml(
            up.url, "    retry: {auto_timeout: {min: 50ms, max: 100ms}}\n    hedge: {enabled: true}"
        ),
        tracing=Tracing(provider),
    )
    import time

    sc.sidecar.states.get("main").latency.ran_long(time.monotonic())  # hedging armed
    async with client.get(sc.url + "/hedged") as resp:
        assert resp.status == 200 and resp.headers["x-retry-hedges"] == "1"
    spans = exporter.get_finished_spans()
    [srv] = [s for s in spans if s.kind is SpanKind.SERVER]
    assert srv.attributes is not None
    assert srv.attributes["retry_sidecar.hedges"] == 1
    assert srv.attributes["retry_sidecar.per_try_timeout"] == 0.1  # auto, cold: its maximum
    attempts = [s for s in spans if s.kind is SpanKind.CLIENT]
    hedges = [a for a in attempts if a.attributes and a.attributes.get("retry_sidecar.hedge")]
    assert len(attempts) == 2 and len(hedges) == 1
    assert hedges[0].attributes is not None
    assert hedges[0].attributes["server.address"] == "127.0.0.1"
    assert hedges[0].attributes["server.port"] == up.port


# -- tracestate goes upstream only with a traceparent (W3C Trace Context section 4.2) ----------

CLIENT_STATE = "vendor=abc,retry-sidecar=forged,other=1"
TRACE_CASES = {
    # name: (the client's trace headers, with tracing off: the traceparent and tracestate the
    # upstream gets; None: no such field)
    "none": ((), (None, None)),
    "tracestate-alone": ((("tracestate", CLIENT_STATE),), (None, None)),
    "traceparent-alone": ((("traceparent", INCOMING),), (INCOMING, "retry-sidecar=edge")),
    "both": (
        (("traceparent", INCOMING), ("tracestate", CLIENT_STATE)),
        (INCOMING, "retry-sidecar=edge,vendor=abc,other=1"),
    ),
    "invalid-traceparent": (
        (("traceparent", "00-" + "0" * 32 + "-b7ad6b7169203331-01"), ("tracestate", CLIENT_STATE)),
        ("00-" + "0" * 32 + "-b7ad6b7169203331-01", None),
    ),
    "two-traceparents": (
        (("traceparent", INCOMING), ("traceparent", INCOMING), ("tracestate", CLIENT_STATE)),
        (f"{INCOMING}, {INCOMING}", None),
    ),
}
VARIANTS = ("keepalive", "close", "http10")


def _traced_request(variant: str, fields: tuple[tuple[str, str], ...]) -> bytes:
    version = b"HTTP/1.0" if variant == "http10" else b"HTTP/1.1"
    head = b"GET /t HTTP/1.1\r\nHost: h\r\n".replace(b"HTTP/1.1", version, 1)
    head += b"".join(f"{k}: {v}\r\n".encode() for k, v in fields)
    if variant != "keepalive":
        head += b"Connection: close\r\n"
    return head + b"\r\n"


async def _send_split(port: int, data: bytes, rng: random.Random) -> bytes:
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        cuts = sorted({0, len(data), *rng.sample(range(1, len(data)), 5)})
        for a, b in itertools.pairwise(cuts):
            w.write(data[a:b])
            await w.drain()
            await asyncio.sleep(0.001)
        return await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 10)
    finally:
        w.close()


@pytest.mark.parametrize("traced", (False, True), ids=("tracing-off", "tracing-on"))
async def test_tracestate_goes_upstream_only_with_a_traceparent(
    upstream_factory, sidecar_factory, traced: bool
):
    """Issue 29 item 12: with tracing off a request without traceparent went upstream with
    ``tracestate: retry-sidecar=edge`` (plus the client's tracestate) and no traceparent,
    which a W3C tracer discards. Now the tracestate (the edge member first, the client's
    members after it, its forged ``retry-sidecar`` member dropped) goes only with a
    traceparent: the client's valid one passed through with tracing off, the attempt's with
    tracing on; the edge marker always travels in ``x-retry-edge``. Every case in HTTP/1.1
    keep-alive, ``Connection: close`` and HTTP/1.0, split at random byte boundaries."""
    tracing = Tracing(TracerProvider()) if traced else Tracing(None)
    up = await upstream_factory(reply(200))
    sc = await sidecar_factory(routes_yaml(up.url), tracing=tracing)
    rng = random.Random(traced)
    wrong = []
    for name, (fields, (parent, state)) in TRACE_CASES.items():
        for variant in VARIANTS:
            answer = await _send_split(sc.sidecar.proxy_port, _traced_request(variant, fields), rng)
            assert b" 200 " in answer.split(b"\r\n", 1)[0], answer
            seen = up.seen.pop()
            got_parent = ", ".join(seen.all("traceparent")) or None
            got_state = seen.header("tracestate")
            if traced:
                # The attempt's own traceparent; the client's tracestate only when its
                # traceparent was one the server span continued.
                assert got_parent is not None and got_parent != INCOMING
                if parent == INCOMING:
                    assert got_parent.split("-")[1] == INCOMING.split("-")[1]
                state = state if parent == INCOMING else "retry-sidecar=edge"
            elif got_parent != parent:
                wrong.append(f"{name} {variant}: traceparent {got_parent!r}, not {parent!r}")
            if got_state != state:
                wrong.append(f"{name} {variant}: tracestate {got_state!r}, not {state!r}")
            if seen.header("x-retry-edge") != "test-edge":
                wrong.append(f"{name} {variant}: x-retry-edge {seen.header('x-retry-edge')!r}")
    assert wrong == [], "\n".join(wrong)


def test_url_full_keeps_query_names_and_redacts_their_values():
    from sidecar.telemetry.tracing import redacted

    assert redacted("/a/b") == "/a/b"
    assert redacted("/a?sig=abc&x=1") == "/a?sig=REDACTED&x=REDACTED"
    # a bare item may be the token itself (?<apikey>): redacted whole; the URL's shape kept
    assert redacted("/a?flag") == "/a?REDACTED"
    assert redacted("/a?") == "/a?"
    assert redacted("/a?x=1&&SECRET5") == "/a?x=REDACTED&&REDACTED"
    # a path parameter holds sessions as a query does (;jsessionid=...)
    assert redacted("/x;jsessionid=S3;v=2/y?k") == "/x;jsessionid=REDACTED;v=REDACTED/y?REDACTED"


def test_unknown_methods_are_other_and_timeouts_are_milliseconds():
    from sidecar.telemetry.tracing import KNOWN_METHODS, otlp_timeout, redacted_path

    assert "GET" in KNOWN_METHODS and "XYZ123RANDOMMETHOD" not in KNOWN_METHODS
    assert otlp_timeout({"OTEL_EXPORTER_OTLP_TIMEOUT": "10000"}) == 10.0
    assert (
        otlp_timeout(
            {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": "250", "OTEL_EXPORTER_OTLP_TIMEOUT": "9"}
        )
        == 0.25
    )
    assert otlp_timeout({"OTEL_EXPORTER_OTLP_TIMEOUT": "soon"}) is None
    assert otlp_timeout({}) is None
    assert redacted_path("/plain/path") == "/plain/path"


def test_server_address_and_port_apart():
    from sidecar.telemetry.tracing import _host_port

    assert _host_port("orders.svc:8080", 80) == ("orders.svc", 8080)
    assert _host_port("[::1]:9000", 80) == ("::1", 9000)
    assert _host_port("[::1]", 80) == ("::1", 80)
    assert _host_port("orders.svc", 443) == ("orders.svc", 443)


async def test_spans_say_https_for_a_tls_listener_and_an_https_upstream(
    sidecar_factory, tmp_path, unused_tcp_port_factory
):
    """``url.scheme`` of the server span says how the client came (the TLS listener), and
    ``url.full`` of an attempt how the upstream was reached (an ``https://`` route)."""
    import ssl

    import aiohttp
    from aiohttp import web

    from tests import tlscerts

    made = tlscerts.make(tmp_path / "tls")
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(made.server.cert, made.server.key)

    async def ok(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{tail:.*}", ok)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    up_port, port = unused_tcp_port_factory(), unused_tcp_port_factory()
    await web.TCPSite(runner, "127.0.0.1", up_port, ssl_context=server_ctx).start()
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    try:
        await sidecar_factory(
            f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:0"}}\n'
            f"server_tls: {{cert_file: {made.server.cert}, key_file: {made.server.key}}}\n"
            f"routes:\n  - name: secure\n    upstream: https://localhost:{up_port}\n"
            f"    tls: {{ca_file: {made.ca}}}\n",
            tracing=Tracing(provider),
        )
        client_ctx = ssl.create_default_context(cafile=made.ca)
        url = f"https://localhost:{port}/x?k=v"
        async with aiohttp.ClientSession() as s, s.get(url, ssl=client_ctx) as resp:
            assert resp.status == 200
    finally:
        await runner.cleanup()
    spans = exporter.get_finished_spans()
    [server] = [s for s in spans if s.kind is SpanKind.SERVER]
    [attempt] = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert server.attributes is not None and attempt.attributes is not None
    assert server.attributes["url.scheme"] == "https"
    assert attempt.attributes["url.full"] == f"https://localhost:{up_port}/x?k=REDACTED"

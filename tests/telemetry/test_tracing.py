"""OpenTelemetry spans with the SDK's in-memory exporter: one SERVER span per request, one
CLIENT span per attempt, each attempt's span the parent the upstream sees."""

from __future__ import annotations

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
    assert srv.name == "GET"
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
    assert hedges[0].attributes["server.address"] == f"127.0.0.1:{up.port}"

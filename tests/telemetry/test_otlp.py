"""Traces of the real process exported to a real OTLP receiver, in both protocols: an HTTP one
(aiohttp, ``POST /v1/traces``) and a gRPC one (grpcio's server with the ``TraceService``), each
decoding the ``opentelemetry-proto`` messages. The sidecar is configured by the standard
``OTEL_*`` variables only."""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
from concurrent import futures
from typing import Any

import aiohttp
import grpc
import pytest
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from tests.conftest import reply
from tests.proc import SidecarProcess, free_port
from tests.telemetry.test_logs import INCOMING, run_sidecar

TRACE_ID = INCOMING.split("-")[1]
PARENT_ID = INCOMING.split("-")[2]
SERVER, CLIENT = 2, 3  # Span.SpanKind in the proto


class Received:
    """What a receiver got: the export requests and the headers (or metadata) they came with."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()

    def add(
        self, msg: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]
    ) -> None:
        with self.lock:
            self.requests.append(msg)
            self.headers.append(headers)

    def spans(self) -> list[tuple[dict[str, Any], Any]]:
        """(resource attributes, span) of every span received."""
        with self.lock:
            out: list[tuple[dict[str, Any], Any]] = []
            for req in self.requests:
                for rs in req.resource_spans:
                    res = attrs(rs.resource.attributes)
                    for ss in rs.scope_spans:
                        out.extend((res, s) for s in ss.spans)
            return out


def value(v: AnyValue) -> Any:
    which = v.WhichOneof("value")
    return getattr(v, which) if which is not None else None


def attrs(kvs: list[KeyValue]) -> dict[str, Any]:
    return {kv.key: value(kv.value) for kv in kvs}


async def http_receiver(got: Received) -> tuple[web.AppRunner, str]:
    async def traces(request: web.Request) -> web.Response:
        msg = trace_service_pb2.ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        got.add(msg, {k.lower(): v for k, v in request.headers.items()})
        return web.Response(
            body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def grpc_receiver(got: Received) -> tuple[grpc.Server, str]:
    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            got.add(request, {k: v for k, v in context.invocation_metadata()})
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"http://127.0.0.1:{port}"


async def wait_spans(
    got: Received, n: int, timeout: float = 15.0
) -> list[tuple[dict[str, Any], Any]]:
    for _ in range(int(timeout / 0.05)):
        spans = got.spans()
        if len(spans) >= n:
            return spans
        await asyncio.sleep(0.05)
    return got.spans()


def otel_env(endpoint: str, protocol: str, **more: str) -> dict[str, str]:
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
        "OTEL_BSP_SCHEDULE_DELAY": "50",
        **more,
    }


@pytest.fixture(autouse=True)
def _no_exporter_named(monkeypatch):
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_PROPAGATORS", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
async def test_spans_by_the_conventions_reach_a_real_receiver(tmp_path, upstream_factory, protocol):
    got = Received()
    if protocol == "grpc":
        server, endpoint = grpc_receiver(got)
    else:
        runner, endpoint = await http_receiver(got)
    up = await upstream_factory(reply(503), reply(200))
    env = otel_env(
        endpoint,
        protocol,
        OTEL_SERVICE_NAME="orders-edge",
        OTEL_RESOURCE_ATTRIBUTES="deployment.environment.name=test,team=payments",
        OTEL_EXPORTER_OTLP_HEADERS="x-tenant=acme",
        OTEL_EXPORTER_OTLP_TIMEOUT="5000",  # milliseconds, as the specification says
    )
    proc = await run_sidecar(tmp_path, up.url, "", env)
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{proc.port}/orders/7?token=secret&v=1"  # type: ignore[attr-defined]
            async with s.get(url, headers={"traceparent": INCOMING}) as resp:
                assert resp.status == 200
        spans = await wait_spans(got, 3)
    finally:
        proc.terminate()
        if protocol == "grpc":
            server.stop(None)
        else:
            await runner.cleanup()
    assert len(spans) == 3, spans
    resource = spans[0][0]
    assert resource["service.name"] == "orders-edge"
    assert resource["deployment.environment.name"] == "test" and resource["team"] == "payments"
    assert resource["service.version"] == "0.1.0"
    assert got.headers[0]["x-tenant"] == "acme"
    [server_span] = [s for _, s in spans if s.kind == SERVER]
    attempts = sorted(
        (s for _, s in spans if s.kind == CLIENT), key=lambda s: s.start_time_unix_nano
    )
    assert server_span.name == "GET orders"
    assert server_span.trace_id.hex() == TRACE_ID and server_span.parent_span_id.hex() == PARENT_ID
    srv = attrs(server_span.attributes)
    assert srv["http.request.method"] == "GET" and srv["http.route"] == "orders"
    assert srv["url.path"] == "/orders/7" and srv["url.scheme"] == "http"
    assert srv["server.address"] == "127.0.0.1" and srv["server.port"] == proc.port  # type: ignore[attr-defined]
    assert srv["http.response.status_code"] == 200 and "error.type" not in srv
    assert srv["retry_sidecar.fate"] == "success" and srv["retry_sidecar.attempts"] == 2
    assert len(attempts) == 2
    first, second = (attrs(a.attributes) for a in attempts)
    for a in attempts:
        assert a.name == "GET" and a.parent_span_id == server_span.span_id
        assert a.trace_id == server_span.trace_id
    assert first["server.address"] == "127.0.0.1" and first["server.port"] == up.port
    assert first["url.full"] == f"http://127.0.0.1:{up.port}/orders/7?token=REDACTED&v=REDACTED"
    assert "http.request.resend_count" not in first and second["http.request.resend_count"] == 1
    assert first["error.type"] == "503" and first["http.response.status_code"] == 503
    assert second["http.response.status_code"] == 200 and "error.type" not in second
    assert all("secret" not in str(attrs(s.attributes)) for _, s in spans)
    # What the upstream saw: each attempt's own span as parent, and our tracestate member.
    sent = [r.header("traceparent") for r in up.seen]
    assert sent == [f"00-{TRACE_ID}-{a.span_id.hex()}-01" for a in attempts]
    assert [r.header("tracestate") for r in up.seen] == ["retry-sidecar=edge"] * 2


async def test_b3_propagation_and_a_sdk_turned_off(tmp_path, upstream_factory):
    got = Received()
    runner, endpoint = await http_receiver(got)
    up = await upstream_factory(reply(200), reply(200), reply(200))
    b3 = {"X-B3-TraceId": TRACE_ID, "X-B3-SpanId": PARENT_ID, "X-B3-Sampled": "1"}
    # A caller's W3C context beside B3: with b3 propagators it is replaced too (dropped), so
    # that no attempt carries two parents.
    b3["traceparent"] = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"
    try:
        proc = await run_sidecar(
            tmp_path, up.url, "", otel_env(endpoint, "http/protobuf", OTEL_PROPAGATORS="b3multi")
        )
        try:
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{proc.port}/b3"  # type: ignore[attr-defined]
                async with s.get(url, headers=b3) as resp:
                    assert resp.status == 200
            spans = await wait_spans(got, 2)
        finally:
            proc.terminate()
        [server_span] = [s for _, s in spans if s.kind == SERVER]
        [attempt] = [s for _, s in spans if s.kind == CLIENT]
        assert (
            server_span.trace_id.hex() == TRACE_ID and server_span.parent_span_id.hex() == PARENT_ID
        )
        seen = up.seen[0]
        assert seen.header("x-b3-traceid") == TRACE_ID
        assert seen.header("x-b3-spanid") == attempt.span_id.hex()
        # No W3C propagator: no traceparent of ours, so no tracestate either.
        assert seen.header("traceparent") is None and seen.header("tracestate") is None

        # A method the conventions do not know is _OTHER (span names stay bounded), and a
        # path parameter or a bare query item never reaches the spans in clear.
        (tmp_path / "other").mkdir()
        b3_env = otel_env(endpoint, "http/protobuf", OTEL_PROPAGATORS="b3multi")
        proc = await run_sidecar(tmp_path / "other", up.url, "", b3_env)
        try:
            async with aiohttp.ClientSession() as s:
                port = proc.port  # type: ignore[attr-defined]
                url = f"http://127.0.0.1:{port}/b3;jsessionid=S3CRET?T0KEN"
                async with s.request("PURGE", url) as resp:
                    assert resp.status == 200
            spans = await wait_spans(got, 4)
        finally:
            proc.terminate()
        [other] = [s for _, s in spans if s.kind == SERVER and s.name != server_span.name]
        [other_attempt] = [s for _, s in spans if s.kind == CLIENT and s.span_id != attempt.span_id]
        assert (other.name, other_attempt.name) == ("HTTP orders", "HTTP")
        for span in (other, other_attempt):
            a = attrs(span.attributes)
            assert a["http.request.method"] == "_OTHER"
            assert a["http.request.method_original"] == "PURGE"
            assert "S3CRET" not in str(a) and "T0KEN" not in str(a), a
        assert attrs(other_attempt.attributes)["url.full"].endswith(
            "/b3;jsessionid=REDACTED?REDACTED"
        )

        # OTEL_SDK_DISABLED: nothing exported, the client's traceparent passed on untouched.
        before = len(got.spans())
        (tmp_path / "off").mkdir()
        off = otel_env(endpoint, "http/protobuf", OTEL_SDK_DISABLED="true")
        proc = await run_sidecar(tmp_path / "off", up.url, "", off)
        try:
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{proc.port}/off"  # type: ignore[attr-defined]
                async with s.get(url, headers={"traceparent": INCOMING}) as resp:
                    assert resp.status == 200
            await asyncio.sleep(0.5)
        finally:
            proc.terminate()
        assert len(got.spans()) == before
        assert up.seen[2].header("traceparent") == INCOMING
    finally:
        await runner.cleanup()


async def test_parent_based_sampling_from_the_environment(tmp_path, upstream_factory):
    got = Received()
    runner, endpoint = await http_receiver(got)
    up = await upstream_factory(reply(200), reply(200))
    env = otel_env(
        endpoint,
        "http/protobuf",
        OTEL_TRACES_SAMPLER="parentbased_traceidratio",
        OTEL_TRACES_SAMPLER_ARG="0",
    )
    try:
        proc = await run_sidecar(tmp_path, up.url, "", env)
        try:
            async with aiohttp.ClientSession() as s:
                url = f"http://127.0.0.1:{proc.port}/s"  # type: ignore[attr-defined]
                async with s.get(url) as resp:  # a root: ratio 0, not sampled
                    assert resp.status == 200
                async with s.get(url, headers={"traceparent": INCOMING}) as resp:  # sampled parent
                    assert resp.status == 200
            spans = await wait_spans(got, 2)
            await asyncio.sleep(0.3)
        finally:
            proc.terminate()
    finally:
        await runner.cleanup()
    spans = got.spans()
    assert {s.trace_id.hex() for _, s in spans} == {TRACE_ID} and len(spans) == 2
    # The unsampled request still tells the upstream it is not sampled (flag bit 0 clear).
    unsampled = up.seen[0].header("traceparent")
    assert unsampled is not None and int(unsampled.rsplit("-", 1)[1], 16) & 1 == 0


async def test_breaker_refusal_dlq_capture_and_idempotency_replay_in_the_spans(
    tmp_path, upstream_factory
):
    got = Received()
    runner, endpoint = await http_receiver(got)
    up = await upstream_factory(reply(503))
    ok = await upstream_factory(reply(201, b"made"))
    port, admin = free_port(), free_port()
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(
        f'version: 1\nlisten: "127.0.0.1:{port}"\nadmin: {{listen: "127.0.0.1:{admin}"}}\n'
        f'dlq: {{path: "{tmp_path}/dlq.sqlite3"}}\n'
        f'idempotency: {{path: "{tmp_path}/idem.sqlite3"}}\n'
        "routes:\n"
        "  - name: writes\n"
        "    match: {path_prefix: /writes}\n"
        f'    upstream: "{ok.url}"\n'
        "    idempotency: {enabled: true}\n"
        "  - name: queued\n"
        "    match: {path_prefix: /queued}\n"
        f'    upstream: "{up.url}"\n'
        "    retry: {attempts: 1}\n"
        "    dlq: {enabled: true, respond: accepted}\n"
        "  - name: fragile\n"
        f'    upstream: "{up.url}"\n'
        "    retry: {attempts: 1}\n"
        "    breaker: {min_sequences: 2, failure_ratio: 0.5, open_for: 30s}\n"
    )
    proc = SidecarProcess(cfg, otel_env(endpoint, "http/protobuf"))
    proc.start()
    try:
        await proc.wait_port(port, admin)
        async with aiohttp.ClientSession() as s:
            for _ in range(2):  # the write, then the same key replayed
                headers = {"Idempotency-Key": '"k1"', "Content-Type": "text/plain"}
                async with s.post(
                    f"http://127.0.0.1:{port}/writes/1", data=b"w", headers=headers
                ) as resp:
                    assert resp.status == 201
            async with s.post(f"http://127.0.0.1:{port}/queued/1", data=b"q") as resp:
                assert resp.status == 202  # stored in the DLQ
            for status in (503, 503, 503):  # two failures open the breaker, the third refused
                async with s.get(f"http://127.0.0.1:{port}/f") as resp:
                    assert resp.status == status
        spans = await wait_spans(got, 2 + 1 + 2 + 3 + 2)
    finally:
        proc.terminate()
        await runner.cleanup()
    servers = [s for _, s in spans if s.kind == SERVER]
    writes = [s for s in servers if s.name == "POST writes"]
    [queued] = [s for s in servers if s.name == "POST queued"]
    fragile = [s for s in servers if s.name == "GET fragile"]
    assert len(writes) == 2 and len(fragile) == 3
    first, replayed = sorted(writes, key=lambda s: s.start_time_unix_nano)
    [capture] = [e for e in queued.events if e.name == "retry_sidecar.dlq.capture"]
    assert attrs(capture.attributes)["retry_sidecar.dlq.result"] == "stored"
    assert attrs(capture.attributes)["retry_sidecar.dlq.record_id"]
    assert attrs(first.attributes)["retry_sidecar.idempotency.result"] == "first"
    assert attrs(replayed.attributes)["retry_sidecar.idempotency.result"] == "replayed"
    refused = sorted(fragile, key=lambda s: s.start_time_unix_nano)[-1]
    assert [e.name for e in refused.events] == ["retry_sidecar.breaker.refused"]
    srv = attrs(refused.attributes)
    assert srv["error.type"] == "breaker-open" and srv["retry_sidecar.fate"] == "breaker-open"
    assert srv["retry_sidecar.attempts"] == 0


async def test_a_collector_that_never_answers_does_not_hold_the_stop(tmp_path, upstream_factory):
    """The last spans get what is left of the drain (and a second), never the exporter's own
    timeout and retries: with OTEL_EXPORTER_OTLP_TIMEOUT at 60 s a stop used to take minutes
    (a pod past its grace period is killed). The collector accepts and never answers."""
    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(16)
    endpoint = f"http://127.0.0.1:{hung.getsockname()[1]}"
    up = await upstream_factory(reply(200))
    env = otel_env(endpoint, "http/protobuf", OTEL_EXPORTER_OTLP_TIMEOUT="60000")
    proc = await run_sidecar(tmp_path, up.url, "drain_timeout: 1s", env)
    assert proc.proc is not None
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{proc.port}/x"  # type: ignore[attr-defined]
            async with s.get(url) as resp:
                assert resp.status == 200
        await asyncio.sleep(0.3)  # the batch is handed to the hung collector
        proc.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.proc.wait, 45)
        assert code == 0
        assert "spans not yet exported were dropped" in proc.stderr()
    finally:
        proc.terminate()
        hung.close()

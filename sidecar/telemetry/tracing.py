"""OpenTelemetry: a SERVER span per proxied request and a CLIENT span per upstream attempt.

Configured by the standard ``OTEL_*`` variables through the SDK's and the exporters' own
support, never parsed here: the exporter by ``OTEL_TRACES_EXPORTER`` and
``OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL`` (the SDK's own resolution to its exporter entry points:
``grpc`` or ``http/protobuf``), its endpoint, headers, timeout, compression and certificates
by the exporter itself, the resource by ``Resource.create`` (``OTEL_SERVICE_NAME``,
``OTEL_RESOURCE_ATTRIBUTES``), the sampler by the ``TracerProvider`` (``OTEL_TRACES_SAMPLER`` /
``_ARG``, parent-based by default), the propagators by ``opentelemetry.propagate``
(``OTEL_PROPAGATORS``: ``tracecontext``, ``baggage``, ``b3``, ``b3multi``), and
``OTEL_SDK_DISABLED`` by the ``TracerProvider`` (its tracers then are no-ops: tracing stays off).
Two defaults are ours: ``OTEL_TRACES_EXPORTER`` unset is ``otlp`` when an OTLP endpoint
variable is set, else ``none`` (a sidecar with no OTEL setting exports nothing and pays
nothing); and with no protocol variable ``otlp`` speaks ``http/protobuf``, the specification's
default (the Python SDK's own is grpc).

Span names and attributes follow the stable HTTP semantic conventions; the names this module
adds (``retry_sidecar.*``) are the span table of docs/observability.md, written once here.
When tracing is off the hot path pays one attribute check. The retry core never imports this
module's OpenTelemetry side: the proxy and the engine call it with the span they were given.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sidecar import __version__
from sidecar.telemetry.logs import TRACE

if TYPE_CHECKING:
    from opentelemetry.propagators.textmap import TextMapPropagator
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

# OpenTelemetry is imported only when tracing is on: its SDK costs ~5 MB of RSS and some start
# time in every sidecar that never exports a span.
log = logging.getLogger("sidecar.tracing")

# The names of the span table (docs/observability.md) that are not the semantic conventions'.
ROUTE = "retry_sidecar.route"
FATE = "retry_sidecar.fate"
ATTEMPTS = "retry_sidecar.attempts"
ATTEMPT = "retry_sidecar.attempt"
HEDGE = "retry_sidecar.hedge"
BREAKER_REFUSED = "retry_sidecar.breaker.refused"
DLQ_CAPTURE = "retry_sidecar.dlq.capture"
DLQ_RESULT = "retry_sidecar.dlq.result"
DLQ_RECORD = "retry_sidecar.dlq.record_id"
IDEMPOTENCY = "retry_sidecar.idempotency.result"

# Headers the sidecar never takes from the propagators: it keeps ``tracestate`` itself (with its
# edge member, and only with a valid traceparent: engine/head.py), and passes ``baggage`` on as
# received (it adds none).
KEPT_AS_RECEIVED = frozenset({"tracestate", "baggage"})
# The trace context headers of every propagator the sidecar offers (W3C, B3 single and multi).
TRACE_CONTEXT_FIELDS = frozenset(
    {
        "traceparent",
        "b3",
        "x-b3-traceid",
        "x-b3-spanid",
        "x-b3-parentspanid",
        "x-b3-sampled",
        "x-b3-flags",
    }
)
OTLP_ENDPOINTS = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
OTLP_PROTOCOLS = ("OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


def otlp_timeout(env: Mapping[str, str]) -> float | None:
    """``OTEL_EXPORTER_OTLP_(TRACES_)TIMEOUT`` in seconds. The specification says milliseconds
    (10000 = 10 s), and so does every other SDK; the Python exporters read the number as
    seconds, so a platform's usual 10000 would wait almost three hours. None: not set (or not a
    number), the exporter's own default (10 s)."""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"):
        raw = env.get(name)
        if raw:
            try:
                ms = float(raw)
            except ValueError:
                log.warning("%s=%r is not a number of milliseconds: ignored", name, raw)
                return None
            if ms > 0:
                return ms / 1000.0
    return None


def correlate(span: Span) -> None:
    """The log lines of this request's task carry the span's ids from here on (a sampled
    span only: an unsampled one is exported nowhere)."""
    ctx = span.get_span_context()
    if ctx.is_valid and ctx.trace_flags.sampled:
        TRACE.set((format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")))


# Methods the semantic conventions know; any other is ``_OTHER`` (span names stay bounded).
KNOWN_METHODS = frozenset(
    {"GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH", "QUERY"}
)


def redacted_path(path: str) -> str:
    """``path`` with the value of each path parameter (``;jsessionid=...``) ``REDACTED``: a
    session id in a path is as secret as one in a query. What spans and the access log show."""
    if ";" not in path:
        return path
    return "/".join(_segment(s) for s in path.split("/"))


def _segment(segment: str) -> str:
    head, *params = segment.split(";")
    return ";".join([head, *(p.partition("=")[0] + "=REDACTED" for p in params)])


def redacted(target: str) -> str:
    """``target`` with its path parameters' values and each query parameter's value replaced by
    ``REDACTED`` (the semantic conventions' advice for ``url.full``: query values may hold
    tokens and signatures); a parameter without ``=`` (``?<token>``) is ``REDACTED`` whole."""
    path, sep, query = target.partition("?")
    path = redacted_path(path)
    if not sep:
        return path
    return path + "?" + "&".join(_parameter(p) for p in query.split("&"))


def _parameter(item: str) -> str:
    if "=" in item:
        return item.partition("=")[0] + "=REDACTED"
    return "REDACTED" if item else ""


def _host_port(authority: str, default: int) -> tuple[str, int]:
    host, sep, port = authority.rpartition(":")
    if sep and port.isdigit() and (not host.startswith("[") or host.endswith("]")):
        return host.strip("[]"), int(port)
    return authority.strip("[]"), default


class Tracing:
    """Disabled unless given a TracerProvider."""

    def __init__(
        self, provider: TracerProvider | None = None, propagator: TextMapPropagator | None = None
    ) -> None:
        from_provider = provider.get_tracer("retry-sidecar", __version__) if provider else None
        if from_provider is not None:
            from opentelemetry.trace import NoOpTracer

            if isinstance(from_provider, NoOpTracer):  # OTEL_SDK_DISABLED=true
                provider, from_provider = None, None
        self.provider = provider
        self.enabled = provider is not None
        self._tracer = from_provider
        if propagator is None and self.enabled:
            from opentelemetry.propagate import get_global_textmap

            propagator = get_global_textmap()  # OTEL_PROPAGATORS
        self._propagator = propagator
        fields = {f.lower() for f in propagator.fields} if propagator is not None else set()
        # Incoming headers replaced with each attempt's own: the configured propagators' and
        # every other trace context a caller may send, so that no attempt carries two parents
        # (a caller's traceparent beside our b3).
        replaced = fields | TRACE_CONTEXT_FIELDS if self.enabled else fields
        self.replaced = frozenset(f.encode() for f in replaced - KEPT_AS_RECEIVED)
        # A traceparent goes upstream with each attempt (and with it our tracestate).
        self.w3c = "traceparent" in fields

    @classmethod
    def from_env(cls, service_name: str) -> Tracing:
        env = os.environ
        default = "otlp" if any(env.get(k) for k in OTLP_ENDPOINTS) else "none"
        asked = [n.strip() for n in env.get("OTEL_TRACES_EXPORTER", default).split(",")]
        http_default = not any(env.get(k) for k in OTLP_PROTOCOLS)
        from opentelemetry.sdk import _configuration as sdk_config
        from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        # The SDK's own resolution of an exporter name and the OTLP protocol variables to its
        # exporter entry points (the functions its auto-configuration runs; private, pinned in
        # requirements.lock and held by tests/telemetry/test_otlp.py).
        try:
            names = [
                "otlp_proto_http"
                if n == "otlp" and http_default
                else sdk_config._get_exporter_entry_point(n, "traces")
                for n in asked
                if n and n.lower() != "none"
            ]
            exporters, _, _ = sdk_config._import_exporters(names, [], [])
        except (RuntimeError, ValueError, ImportError) as exc:
            log.warning(
                "tracing stays off: %s (the OTLP exporters: pip install 'retry-sidecar[otlp]')",
                exc,
            )
            return cls(None)
        if not exporters:
            return cls(None)
        resource = Resource.create({SERVICE_VERSION: __version__})
        if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
            resource = resource.merge(Resource({SERVICE_NAME: service_name}))
        # Shut down by the app within the drain (shutdown), never by an exit hook that waits
        # for an unreachable collector as long as the exporter's timeout says.
        provider = TracerProvider(resource=resource, shutdown_on_exit=False)
        from opentelemetry.trace import NoOpTracer

        if isinstance(provider.get_tracer(__name__), NoOpTracer):  # OTEL_SDK_DISABLED=true
            return cls(None)  # before any exporter or its thread is made
        timeout = otlp_timeout(env)
        for name, exporter in exporters.items():
            # both OTLP exporters take it, in seconds
            given = {"timeout": timeout} if timeout and name.startswith("otlp") else {}
            provider.add_span_processor(BatchSpanProcessor(exporter(**given)))
        return cls(provider)

    def start_server(
        self,
        method: str,
        target: str,
        route: str,
        headers: Mapping[str, str],
        peer: str,
        *,
        tls: bool = False,
    ) -> Span:
        from opentelemetry.trace import SpanKind

        assert self._tracer is not None and self._propagator is not None
        parent = self._propagator.extract(carrier=headers)
        host, port = _host_port(headers.get("Host", ""), 443 if tls else 80)
        known = method in KNOWN_METHODS
        attrs: dict[str, str | int] = {
            "http.request.method": method if known else "_OTHER",
            "http.route": route,  # the route's name: see docs/observability.md
            "url.path": redacted_path(target.partition("?")[0]),
            "url.scheme": "https" if tls else "http",
            "client.address": peer,
            ROUTE: route,
        }
        if host:
            attrs["server.address"] = host
            attrs["server.port"] = port
        if not known:
            attrs["http.request.method_original"] = method
        agent = headers.get("User-Agent")
        if agent:
            attrs["user_agent.original"] = agent
        span = self._tracer.start_span(
            f"{method if known else 'HTTP'} {route}",
            context=parent,
            kind=SpanKind.SERVER,
            attributes=attrs,
        )
        correlate(span)
        return span

    def start_attempt(
        self,
        server: Span,
        method: str,
        attempt: int,
        endpoint: tuple[str, str, int],
        hedge: bool = False,
        *,
        target: str = "",
        tls: bool = False,
    ) -> Span:
        """``endpoint``: its configured name (``host:port``), and where it connects to."""
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        assert self._tracer is not None
        name, ip, port = endpoint
        host, _ = _host_port(name, port)
        known = method in KNOWN_METHODS
        attrs: dict[str, str | int | bool] = {
            "http.request.method": method if known else "_OTHER",
            "server.address": host,
            "server.port": port,
            "network.peer.address": ip,
            "url.full": f"{'https' if tls else 'http'}://{name}{redacted(target)}",
            ATTEMPT: attempt,
        }
        if not known:
            attrs["http.request.method_original"] = method
        if attempt > 1:
            attrs["http.request.resend_count"] = attempt - 1
        if hedge:
            attrs[HEDGE] = True  # this attempt races a slower one still running
        return self._tracer.start_span(
            method if known else "HTTP",
            context=trace.set_span_in_context(server),
            kind=SpanKind.CLIENT,
            attributes=attrs,
        )

    def inject(self, span: Span) -> bytes:
        """The propagators' headers for an attempt whose span is ``span``, as header lines."""
        from opentelemetry import trace

        assert self._propagator is not None
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return b"".join(
            f"{k}: {v}\r\n".encode("latin-1")
            for k, v in carrier.items()
            if k.lower() not in KEPT_AS_RECEIVED
        )

    @staticmethod
    def end_attempt(span: Span, status: int | None, error_type: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:  # a client span's error (semantic conventions)
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    @staticmethod
    def end_server(
        span: Span, status: int, fate: str, attempts: int, error_type: str | None = None
    ) -> None:
        """``error_type``: the outcome row's name when the sidecar answered itself."""
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        span.set_attribute(FATE, fate)
        span.set_attribute(ATTEMPTS, attempts)
        if error_type is not None or status >= 500:  # a server span's error: 5xx only
            span.set_attribute("error.type", error_type or str(status))
        if status >= 500:
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    @staticmethod
    def breaker_refused(span: Span, retry_in: float) -> None:
        span.add_event(BREAKER_REFUSED, {"retry_sidecar.breaker.retry_in": retry_in})

    @staticmethod
    def dlq_captured(span: Span, result: str, record_id: str | None) -> None:
        attrs = {DLQ_RESULT: result}
        if record_id:
            attrs[DLQ_RECORD] = record_id
        span.add_event(DLQ_CAPTURE, attrs)

    @staticmethod
    def idempotency(span: Span, result: str) -> None:
        span.set_attribute(IDEMPOTENCY, result)

    def shutdown(self, timeout: float) -> bool:
        """Flush and stop the exporters, waiting at most ``timeout`` seconds (what is left of
        the drain): an unreachable collector must not hold the process past it. The flush runs
        in a daemon thread, which a process that has to go leaves behind. True if it finished."""
        provider = self.provider
        if provider is None:
            return True
        done = threading.Thread(target=provider.shutdown, name="otel-shutdown", daemon=True)
        done.start()
        done.join(max(0.0, timeout))
        if done.is_alive():
            log.warning(
                "spans not yet exported were dropped: the collector did not take them within "
                "the %.1fs left of the drain",
                timeout,
            )
            return False
        return True

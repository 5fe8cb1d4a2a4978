"""OpenTelemetry: a SERVER span per proxied request and a CLIENT span per upstream attempt.

Each attempt's span is the parent named in the ``traceparent`` sent upstream with that attempt.
Attribute names follow the HTTP semantic conventions (``http.request.method``,
``http.response.status_code``, ``http.request.resend_count`` on attempts after the first,
``error.type`` on failures). Tracing is off unless configured through the standard OTEL_*
variables (``OTEL_TRACES_EXPORTER=otlp|console``); when off, the hot path pays one attribute check.
The retry core never imports this module: the proxy handler calls it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from sidecar import __version__
from sidecar.telemetry.logs import TRACE

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.trace import Span

# OpenTelemetry is imported only when tracing is on: its SDK costs ~5 MB of RSS and some start
# time in every sidecar that never exports a span.
log = logging.getLogger("sidecar.tracing")


def correlate(span: Span) -> None:
    """The log lines of this request's task carry the span's ids from here on."""
    ctx = span.get_span_context()
    if ctx.is_valid:
        TRACE.set((format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")))


class Tracing:
    """Disabled unless given a TracerProvider."""

    def __init__(self, provider: TracerProvider | None = None) -> None:
        self.provider = provider
        self.enabled = provider is not None
        self._tracer = provider.get_tracer("retry-sidecar", __version__) if provider else None

    @classmethod
    def from_env(cls, service_name: str) -> Tracing:
        exporter_name = os.environ.get("OTEL_TRACES_EXPORTER", "none").strip().lower()
        if exporter_name in ("", "none"):
            return cls(None)
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            ConsoleSpanExporter,
            SpanExporter,
        )

        exporter: SpanExporter
        if exporter_name == "console":
            exporter = ConsoleSpanExporter()
        elif exporter_name == "otlp":
            try:
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # type: ignore[import-not-found,unused-ignore]
                    OTLPSpanExporter,
                )
            except ImportError:
                log.warning(
                    "OTEL_TRACES_EXPORTER=otlp but the OTLP exporter is not installed "
                    "(pip install 'retry-sidecar[otlp]'); tracing stays off"
                )
                return cls(None)
            exporter = OTLPSpanExporter()
        else:
            log.warning("unsupported OTEL_TRACES_EXPORTER=%s; tracing stays off", exporter_name)
            return cls(None)
        resource = Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME", service_name)}
        )
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider)

    def start_server(
        self, method: str, target: str, route: str, headers: Mapping[str, str], peer: str
    ) -> Span:
        from opentelemetry.trace import SpanKind
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        assert self._tracer is not None
        parent = TraceContextTextMapPropagator().extract(carrier=headers)
        span = self._tracer.start_span(
            method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": method,
                "url.path": target.split("?", 1)[0],
                "client.address": peer,
                "retry_sidecar.route": route,
            },
        )
        correlate(span)
        return span

    def start_attempt(
        self, server: Span, method: str, attempt: int, upstream: str, hedge: bool = False
    ) -> Span:
        from opentelemetry import trace
        from opentelemetry.trace import SpanKind

        assert self._tracer is not None
        attrs: dict[str, str | int] = {
            "http.request.method": method,
            "server.address": upstream,
            "retry_sidecar.attempt": attempt,
        }
        if attempt > 1:
            attrs["http.request.resend_count"] = attempt - 1
        if hedge:
            attrs["retry_sidecar.hedge"] = 1  # this attempt races a slower one still running
        return self._tracer.start_span(
            method,
            context=trace.set_span_in_context(server),
            kind=SpanKind.CLIENT,
            attributes=attrs,
        )

    @staticmethod
    def traceparent(span: Span) -> bytes:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        carrier: dict[str, str] = {}
        TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
        return carrier.get("traceparent", "").encode("ascii")

    @staticmethod
    def end_attempt(span: Span, status: int | None, error_type: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 500:
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))
        if error_type is not None:
            span.set_attribute("error.type", error_type)
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    @staticmethod
    def end_server(span: Span, status: int, fate: str, attempts: int) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute("http.response.status_code", status)
        span.set_attribute("retry_sidecar.fate", fate)
        span.set_attribute("retry_sidecar.attempts", attempts)
        if status >= 500:
            span.set_attribute("error.type", str(status))
            span.set_status(Status(StatusCode.ERROR))
        span.end()

    def shutdown(self) -> None:
        if self.provider is not None:
            self.provider.shutdown()

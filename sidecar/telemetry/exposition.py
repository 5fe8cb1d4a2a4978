"""What ``GET /metrics`` answers: the sidecar's series, then the standard process ones.

The process series (``process_cpu_seconds_total``, ``process_resident_memory_bytes``,
``process_open_fds``, ``process_max_fds``, ``process_start_time_seconds``,
``process_virtual_memory_bytes``), ``python_info`` and ``python_gc_*`` are prometheus_client's
own collectors, so they are named and computed exactly as every Python service's are. The
format is the scraper's choice, read from ``Accept`` with prometheus_client's ``choose_encoder``:
OpenMetrics 1.0 when it asks for ``application/openmetrics-text`` (then the request-duration
histogram's buckets carry exemplars with the trace id of a request that fell in them), else the
text format 0.0.4, whose sidecar series our own renderer writes as before (their text is
unchanged for every dashboard and test that reads it). Runs at scrape only, never per request.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.exposition import generate_latest as text_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Exemplar

from sidecar.telemetry.metrics import Counter, Gauge, Histogram, Metrics

TEXT_0_0_4 = "text/plain; version=0.0.4; charset=utf-8"
OPENMETRICS = "application/openmetrics-text"

# The default collectors prometheus_client registers in its global registry (one set per
# process), in a registry of their own: nothing else of that global registry is exported.
_STANDARD = CollectorRegistry(auto_describe=False)
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    _STANDARD.register(_collector)


class _Ours(Collector):
    """The sidecar's series as prometheus_client metric families (for its OpenMetrics
    exposition), read from our registry at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        for m in self.metrics.all():
            if isinstance(m, Counter):
                yield _counter(m)
            elif isinstance(m, Gauge):
                yield _gauge(m)
            else:
                yield _histogram(m)
        yield from _STANDARD.collect()


def _counter(c: Counter) -> Metric:
    out = Metric(c.name.removesuffix("_total"), c.help, "counter")
    for labels, v in sorted(c.values.items()):
        out.add_sample(c.name, dict(labels), v)
    return out


def _gauge(g: Gauge) -> Metric:
    out = Metric(g.name, g.help, "gauge")
    for labels, v in sorted(g.current().items()):
        out.add_sample(g.name, dict(labels), v)
    return out


def _histogram(h: Histogram) -> Metric:
    out = Metric(h.name, h.help, "histogram")
    for labels, s in sorted(h.series.items()):
        exemplars = h.exemplars.get(labels, {})
        cum = 0.0
        for i, le in enumerate((*h.buckets, float("inf"))):
            cum += s[i]
            ex = exemplars.get(i)
            out.add_sample(
                h.name + "_bucket",
                {**dict(labels), "le": _le(le)},
                cum,
                exemplar=Exemplar({"trace_id": ex[0]}, ex[1]) if ex is not None else None,
            )
        out.add_sample(h.name + "_count", dict(labels), cum)
        out.add_sample(h.name + "_sum", dict(labels), s[-1])
    return out


def _le(bound: float) -> str:
    """A bucket bound as OpenMetrics writes it (canonical float: ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


def scrape(metrics: Metrics, accept: str) -> tuple[bytes, str]:
    """The body and the Content-Type of ``GET /metrics`` for a scraper that sent ``accept``."""
    encoder, content_type = choose_encoder(accept)
    if content_type.startswith(OPENMETRICS):
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Ours(metrics))
        return encoder(registry), content_type
    return metrics.render().encode() + text_latest(_STANDARD), TEXT_0_0_4

"""``GET /metrics`` of the real process: the build info and the standard process series in the
text format, and OpenMetrics with trace-id exemplars when the scraper asks for it."""

from __future__ import annotations

import shutil
import subprocess
import time

import aiohttp
from prometheus_client.openmetrics.parser import text_string_to_metric_families

from sidecar import __version__, build
from tests.conftest import reply
from tests.telemetry.test_logs import INCOMING, run_sidecar

# What Prometheus 3 sends when scraping.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;escaping=allow-utf-8;q=0.6,"
    "application/openmetrics-text;version=0.0.1;q=0.5,text/plain;version=1.0.0;"
    "escaping=allow-utf-8;q=0.4,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)
PROCESS_SERIES = (
    "process_cpu_seconds_total",
    "process_resident_memory_bytes",
    "process_virtual_memory_bytes",
    "process_open_fds",
    "process_max_fds",
    "process_start_time_seconds",
)


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def test_text_format_has_build_info_and_process_series(tmp_path, upstream_factory):
    up = await upstream_factory(reply(200))
    started = time.time()
    proc = await run_sidecar(tmp_path, up.url, "", {})
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{proc.admin}/metrics"  # type: ignore[attr-defined]
            async with s.get(url) as resp:
                assert resp.status == 200
                assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
                text = await resp.text()
    finally:
        proc.terminate()
    got = _samples(text)
    # The process imports the same checkout as this test: the same version and build.
    assert got[f'retry_sidecar_build_info{{version="{__version__}",build="{build()}"}}'] == 1
    for name in PROCESS_SERIES:
        assert name in got, name
    assert got["process_resident_memory_bytes"] > 1e6
    assert got["process_open_fds"] > 3
    assert started - 30 < got["process_start_time_seconds"] <= time.time()
    assert "python_info{" in text
    # The sidecar's own series as before.
    assert 'retry_sidecar_requests_total{route="orders",fate="success"} 0' in text
    promtool = shutil.which("promtool")
    if promtool is not None:
        res = subprocess.run(
            [promtool, "check", "metrics"], input=text, capture_output=True, text=True
        )
        assert "error" not in (res.stdout + res.stderr).lower(), res.stdout + res.stderr


async def test_openmetrics_when_asked_with_trace_exemplars(tmp_path, upstream_factory):
    up = await upstream_factory(reply(200))
    env = {"OTEL_TRACES_EXPORTER": "console", "OTEL_TRACES_SAMPLER": "parentbased_always_on"}
    proc = await run_sidecar(tmp_path, up.url, "", env)
    try:
        async with aiohttp.ClientSession() as s:
            url = f"http://127.0.0.1:{proc.port}/x"  # type: ignore[attr-defined]
            async with s.get(url, headers={"traceparent": INCOMING}) as resp:
                assert resp.status == 200
            url = f"http://127.0.0.1:{proc.admin}/metrics"  # type: ignore[attr-defined]
            async with s.get(url, headers={"Accept": PROMETHEUS_ACCEPT}) as resp:
                assert resp.status == 200
                content_type = resp.headers["Content-Type"]
                text = await resp.text()
    finally:
        proc.terminate()
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert text.endswith("# EOF\n")
    families = {f.name: f for f in text_string_to_metric_families(text)}  # a strict parser
    duration = families["retry_sidecar_request_duration_seconds"]
    exemplars = [smp.exemplar for smp in duration.samples if smp.exemplar is not None]
    assert [e.labels for e in exemplars] == [{"trace_id": INCOMING.split("-")[1]}]
    assert families["retry_sidecar_requests"].type == "counter"
    for name in ("process_cpu_seconds", "process_resident_memory_bytes", "process_open_fds"):
        assert name in families, name
    [info] = families["retry_sidecar_build_info"].samples
    assert info.labels == {"version": __version__, "build": build()} and info.value == 1

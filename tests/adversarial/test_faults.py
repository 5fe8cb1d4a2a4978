"""Upstream faults through the in-repo fault proxy: the right retry decision, the right client
status, no truncated 200 that looks whole, and no leaked upstream connection."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web

from sidecar.upstream.pool import PoolSettings
from tests import faults
from tests.conftest import routes_yaml
from tests.rawhttp import raw_server
from tests.wait import until

POLICY = "    retry: {attempts: 2, per_try_timeout: 300ms}\n    breaker: {min_sequences: 100000}"


def assert_no_leak(sc) -> None:
    for stats in sc.sidecar.client.stats().values():
        assert stats.total == stats.idle, stats  # nothing in use, nothing lost


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        (faults.reset_before_request, "reset"),
        (faults.reset_after_request, "reset"),
        (faults.head_never_finishes, "per-try-timeout"),
        (faults.half_close, "reset"),
        (faults.garbage, "reset"),
    ],
)
async def test_fault_then_recovery_is_retried(sidecar_factory, client, fault, outcome):
    async with raw_server(faults.per_connection(fault, faults.ok)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == 200 and await resp.read() == b"ok"
            assert resp.headers["x-retry-attempts"] == "2"
        assert [a.outcome for a in sc.recorder.attempts] == [outcome, "200"]
        assert_no_leak(sc)


@pytest.mark.parametrize(
    ("fault", "status", "code"),
    [
        (faults.reset_after_request, 502, "upstream-reset"),
        (faults.head_never_finishes, 504, "per-try-timeout"),
        (faults.garbage, 502, "upstream-reset"),
        (faults.half_close, 502, "upstream-reset"),
    ],
)
async def test_persistent_fault_gives_the_right_status(
    sidecar_factory, client, fault, status, code
):
    async with raw_server(fault) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        async with client.get(sc.url + "/x") as resp:
            assert resp.status == status
            assert resp.headers["x-retry-proxy-error"] == code
            assert resp.headers["x-retry-attempts"] == "2"
        assert_no_leak(sc)


async def test_post_without_key_is_not_resent_after_a_reset(sidecar_factory, client):
    async with raw_server(faults.per_connection(faults.reset_after_request, faults.ok)) as port:
        sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{port}", POLICY))
        async with client.post(sc.url + "/x", data=b"{}") as resp:
            assert resp.status == 502 and resp.headers["x-retry-fate"] == "non-idempotent"
        assert_no_leak(sc)


@pytest.mark.parametrize(
    ("fault", "code"),
    [(faults.reset_mid_body, "upstream-reset"), (faults.slow_drip, "stream-idle-timeout")],
)
async def test_body_faults_never_give_a_truncated_whole_response(
    sidecar_factory, client, fault, code, caplog
):
    async with raw_server(fault) as port:
        sc = await sidecar_factory(
            routes_yaml(f"http://127.0.0.1:{port}", POLICY + "\n    stream_idle_timeout: 300ms")
        )
        with pytest.raises(aiohttp.ClientPayloadError):
            async with client.get(sc.url + "/x") as resp:
                assert resp.status == 200  # the head went out before the body broke
                await resp.read()
        await asyncio.sleep(0.1)
        assert_no_leak(sc)
        assert [a.outcome for a in sc.recorder.attempts] == ["200"]  # never retried
        # Recorded as what it is, not a success, and logged at the default level.
        [seq] = sc.recorder.sequences
        assert (seq.fate, seq.proxy_error) == ("body-broken", code)
        assert any(
            r.levelname == "WARNING" and "broke mid-body" in r.getMessage() for r in caplog.records
        )
        metrics = sc.sidecar.metrics.render()
        assert 'retry_sidecar_requests_total{route="main",fate="body-broken"} 1' in metrics


async def test_connection_refused_is_a_connect_failure(sidecar_factory, client, unused_tcp_port):
    sc = await sidecar_factory(routes_yaml(f"http://127.0.0.1:{unused_tcp_port}", POLICY))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 502 and resp.headers["x-retry-proxy-error"] == "connect-failure"
    assert [a.outcome for a in sc.recorder.attempts] == ["connect-failure"] * 2


async def test_pool_exhausted_gives_a_distinct_503(upstream_factory, sidecar_factory, client):
    release = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        await release.wait()
        return web.Response(text="slow")

    up = await upstream_factory(held)
    sc = await sidecar_factory(
        routes_yaml(up.url, "    retry: {per_try_timeout: 30s}"),
        pool=PoolSettings(max_connections=1, wait_timeout=0.1),
    )
    first = asyncio.create_task(client.get(sc.url + "/x"))
    # The first request holds the only connection, at the upstream until released.
    await until(lambda: len(up.seen) == 1, "the first request to reach the upstream")
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 503
        assert resp.headers["x-retry-proxy-error"] == "pool-exhausted"
        assert resp.headers["x-retry-fate"] == "overloaded"
    assert len(up.seen) == 1
    release.set()
    r1 = await first
    assert r1.status == 200
    r1.release()
    assert_no_leak(sc)


async def test_pool_returns_to_its_size_after_mixed_faults(sidecar_factory, client):
    mix = faults.per_connection(
        faults.reset_after_request, faults.garbage, faults.half_close, faults.ok
    )
    async with raw_server(mix) as port:
        sc = await sidecar_factory(
            routes_yaml(
                f"http://127.0.0.1:{port}", "    retry: {attempts: 4, per_try_timeout: 300ms}"
            )
        )
        for _ in range(5):
            async with client.get(sc.url + "/x") as resp:
                assert resp.status == 200
        [stats] = sc.sidecar.client.stats().values()
        assert stats.total == stats.idle == 1


@pytest.mark.slow
async def test_idle_pooled_connections_are_closed_after_the_idle_timeout(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory()
    sc = await sidecar_factory(routes_yaml(up.url, top_extra="upstream_pool: {idle_timeout: 1s}"))
    async with client.get(sc.url + "/x") as resp:
        assert resp.status == 200
    [stats] = sc.sidecar.client.stats().values()
    assert stats.idle == 1  # (read well inside the idle timeout, even on a stalled machine)
    await asyncio.sleep(1.3)  # a loop timer after the pool's: it has fired by then
    [stats] = sc.sidecar.client.stats().values()
    assert stats.total == stats.idle == 0


async def test_slow_upload_longer_than_the_per_try_timeout_still_succeeds(
    upstream_factory, sidecar_factory, client
):
    up = await upstream_factory()
    sc = await sidecar_factory(
        routes_yaml(up.url, "    retry: {per_try_timeout: 300ms, max_body_bytes: 16}")
    )

    async def slow_body():
        for _ in range(6):
            await asyncio.sleep(0.1)  # 0.6 s in all, twice the per-try timeout
            yield b"x" * 1000

    async with client.put(sc.url + "/upload", data=slow_body()) as resp:
        assert resp.status == 200 and resp.headers["x-retry-fate"] == "success"
    assert len(up.seen[0].body) == 6000


async def test_upstream_that_stops_reading_the_body_is_a_per_try_timeout(sidecar_factory, client):
    async def never_reads(r, w):
        await faults.read_request(r)
        await asyncio.sleep(30)

    async with raw_server(never_reads) as port:
        sc = await sidecar_factory(
            routes_yaml(
                f"http://127.0.0.1:{port}",
                "    retry: {per_try_timeout: 300ms}",
                top_extra="limits: {max_request_body: 64MiB}",
            ),
        )
        # More than loopback socket buffers hold, so the sidecar's writes really stall; without
        # the drain bound the attempt would hang until the upstream closes (30 s, a "reset").
        big = b"y" * (32 * 1024 * 1024)

        async def chunks():
            for i in range(0, len(big), 65536):
                yield big[i : i + 65536]

        try:
            async with client.put(sc.url + "/x", data=chunks()) as resp:
                await resp.read()
        except aiohttp.ClientError:
            pass  # the sidecar may answer before the client finished sending
        assert [a.outcome for a in sc.recorder.attempts] == ["per-try-timeout"]
        assert_no_leak(sc)

"""The real process: drain on SIGTERM, reload on SIGHUP, healthcheck, kill switch vs restart."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
from aiohttp import web

from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port
from tests.wait import until, until_async


def process_yaml(up_url: str, port: int, admin_port: int, extra: str = "", top: str = "") -> str:
    return routes_yaml(
        up_url, extra, top_extra=top, admin=f'admin: {{listen: "127.0.0.1:{admin_port}"}}'
    ).replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1)


async def started(tmp_path, text: str, port: int, admin: int) -> SidecarProcess:
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    proc = SidecarProcess(cfg)
    proc.start()
    await proc.wait_port(port, admin)
    return proc


async def readyz(s: aiohttp.ClientSession, admin: int) -> int:
    async with s.get(f"http://127.0.0.1:{admin}/readyz") as r:
        return r.status


async def test_sigterm_drains_in_flight_requests_then_exits_0(upstream_factory, tmp_path):
    release = asyncio.Event()

    async def slow(request: web.Request) -> web.StreamResponse:
        # In flight until the test has seen the drain begin: no sleep to race against.
        await release.wait()
        return web.Response(text="finished")

    up = await upstream_factory(slow)
    port, admin = free_port(), free_port()
    # A drain long enough for the checks below on any machine: the upstream answers as soon
    # as they are done, so the test does not wait for it.
    proc = await started(
        tmp_path, process_yaml(up.url, port, admin, top="drain_timeout: 60s"), port, admin
    )
    async with aiohttp.ClientSession() as s:
        inflight = asyncio.create_task(s.get(f"http://127.0.0.1:{port}/slow"))
        await until(lambda: len(up.seen) == 1, "the request to reach the upstream")
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        # Not ready any more while it drains, but still alive. The drain marks the process
        # not ready and closes the proxy listener in one step of the loop (Sidecar.stop).
        deadline = time.monotonic() + 15.0
        while (status := await readyz(s, admin)) == 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert status == 503
        # No new connections on the proxy port.
        try:
            await asyncio.open_connection("127.0.0.1", port)
            refused = False
        except OSError:
            refused = True
        assert refused
        assert not inflight.done()
        release.set()
        resp = await inflight
        assert resp.status == 200 and await resp.read() == b"finished"
        resp.release()
    rc = await asyncio.to_thread(proc.proc.wait, 10)
    assert rc == 0


async def test_drain_cuts_a_backoff_sleep_short(upstream_factory, tmp_path):
    up = await upstream_factory(
        reply(503, b"", {"Retry-After": "20"}), reply(200, b"final attempt")
    )
    port, admin = free_port(), free_port()
    text = process_yaml(
        up.url,
        port,
        admin,
        "    timeout: 60s\n    retry: {retry_after: {max: 30s}}",
        top="drain_timeout: 5s",
    )
    proc = await started(tmp_path, text, port, admin)
    async with aiohttp.ClientSession() as s:
        t0 = time.monotonic()
        inflight = asyncio.create_task(s.get(f"http://127.0.0.1:{port}/x"))
        # The first attempt has reached the upstream: the request is in flight, and the
        # sidecar is (or is about to be) sleeping out the 20 s Retry-After.
        await until(lambda: len(up.seen) == 1, "the first attempt to reach the upstream")
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGTERM)
        resp = await inflight
        assert resp.status == 200 and await resp.read() == b"final attempt"
        assert resp.headers["x-retry-fate"] == "success"
        resp.release()
        assert time.monotonic() - t0 < 10
    assert await asyncio.to_thread(proc.proc.wait, 10) == 0


async def test_sighup_reloads(upstream_factory, tmp_path):
    up = await upstream_factory(reply(503))
    port, admin = free_port(), free_port()
    text = process_yaml(up.url, port, admin, "    retry: {attempts: 1}")
    proc = await started(tmp_path, text, port, admin)
    try:
        (tmp_path / "sidecar.yaml").write_text(text.replace("attempts: 1", "attempts: 2"))
        assert proc.proc is not None
        proc.proc.send_signal(signal.SIGHUP)
        async with aiohttp.ClientSession() as s:
            deadline = time.monotonic() + 15.0
            seen = None
            while time.monotonic() < deadline:
                async with s.get(f"http://127.0.0.1:{port}/x") as r:
                    seen = r.headers["x-retry-attempts"]
                if seen == "2":
                    break
                await asyncio.sleep(0.05)
            assert seen == "2"
    finally:
        assert proc.terminate() == 0


async def test_healthcheck_cli(upstream_factory, tmp_path):
    up = await upstream_factory(reply(200))
    port, admin = free_port(), free_port()
    proc = await started(tmp_path, process_yaml(up.url, port, admin), port, admin)
    cfg = str(tmp_path / "sidecar.yaml")
    try:
        ok = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "sidecar", "healthcheck", "--config", cfg],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert ok.returncode == 0, ok.stderr
    finally:
        proc.terminate()
    down = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "sidecar", "healthcheck", "--config", cfg],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert down.returncode == 1 and "unhealthy" in down.stderr


async def test_kill_switch_does_not_survive_a_restart(upstream_factory, tmp_path):
    """Decided: the switch is in memory only; a restart comes back with the file's policy."""
    up = await upstream_factory(reply(200))
    port, admin = free_port(), free_port()
    text = process_yaml(up.url, port, admin)
    proc = await started(tmp_path, text, port, admin)
    base = f"http://127.0.0.1:{admin}"
    async with aiohttp.ClientSession() as s:
        async with s.put(
            base + "/killswitch", json={"scope": "global", "ttl": "1h", "reason": "r"}
        ) as r:
            assert r.status == 200
        async with s.get(base + "/killswitch") as r:
            assert len((await r.json())["switches"]) == 1
        assert proc.terminate() == 0
        proc = await started(tmp_path, text, port, admin)
        try:
            async with s.get(base + "/killswitch") as r:
                assert (await r.json())["switches"] == []
        finally:
            proc.terminate()


async def test_the_cli_reaches_an_admin_on_ipv6_any_and_never_through_an_http_proxy(
    upstream_factory, tmp_path
):
    """``admin.listen: "[::]:P"`` is bound IPv6-only: the CLI turned ``::`` into 127.0.0.1 and
    reported a healthy sidecar dead (a container health check would restart it). And with
    ``http_proxy`` set, urllib sent the CLI's calls -- the admin token with them -- to the
    proxy, even for a loopback address. The CLI goes to ``[::1]``, directly."""
    from tests.rawhttp import raw_server, read_head

    up = await upstream_factory(reply(200))
    port, admin = free_port(), free_port()
    text = process_yaml(up.url, port, admin).replace(
        f'admin: {{listen: "127.0.0.1:{admin}"}}', f'admin: {{listen: "[::]:{admin}"}}'
    )
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    proc = SidecarProcess(cfg, env={"RETRY_SIDECAR_ADMIN_TOKEN": "secret-token"})
    proc.start()
    proxied: list[bytes] = []

    async def record(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        proxied.append(await read_head(r))
        w.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        await w.drain()
        w.close()

    try:
        await proc.wait_port(port)

        async def admin_listens() -> bool:
            try:
                _, w = await asyncio.open_connection("::1", admin)
            except OSError:
                return False
            w.close()
            return True

        await until_async(admin_listens, "the admin listener on [::1]")
        async with raw_server(record) as proxy_port:
            env = {
                **os.environ,
                "http_proxy": f"http://127.0.0.1:{proxy_port}",
                "HTTP_PROXY": f"http://127.0.0.1:{proxy_port}",
                "no_proxy": "",
                "RETRY_SIDECAR_ADMIN_TOKEN": "secret-token",
            }
            for verb in (["healthcheck"], ["killswitch", "list"]):
                res = await asyncio.to_thread(
                    subprocess.run,
                    [sys.executable, "-m", "sidecar", *verb, "--config", str(cfg)],
                    capture_output=True,
                    text=True,
                    timeout=30,
                    env=env,
                )
                assert res.returncode == 0, (verb, res.stdout, res.stderr)
        assert proxied == []
    finally:
        assert proc.terminate() == 0

"""Make docs/status-page.png: a sidecar in the middle of an incident, seen in chromium.

    python3 -m tests.screenshot docs/status-page.png

Three routes on loopback: ``orders`` (a flaky upstream, writes to the DLQ, one record parked),
``payments`` (an upstream that is down: the breaker is open) and ``catalog`` (retries switched
off by a kill switch in the policy file).
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import sys
import tempfile
from pathlib import Path

import aiohttp
from aiohttp import web

from sidecar.app import Sidecar
from sidecar.config.parse import parse_text
from tests.browser import browser, why_not

POLICY = """
version: 1
name: shop-7f9c4-retry-sidecar
listen: "127.0.0.1:0"
admin: {{listen: "127.0.0.1:0", token_env: SCREENSHOT_ADMIN_TOKEN}}
dlq: {{path: "{db}"}}
killswitches:
  - scope: route:catalog
    reason: "INC-204: catalog DB failing over, retries amplify the load"
    until: "{until}"
routes:
  - name: orders
    match: {{path_prefix: /orders}}
    upstream: "{up}"
    retry: {{attempts: 3, backoff: {{strategy: constant, base: 1ms, max: 1ms}}}}
    dlq: {{enabled: true}}
    breaker: {{min_sequences: 100000}}
  - name: payments
    match: {{path_prefix: /payments}}
    upstream: "{up}"
    retry: {{attempts: 2, backoff: {{strategy: constant, base: 1ms, max: 1ms}}}}
    breaker: {{min_sequences: 20, open_for: 30s}}
  - name: catalog
    match: {{path_prefix: /}}
    upstream: "{up}"
"""


async def upstream(request: web.Request) -> web.Response:
    await request.read()
    path = request.path
    if path.startswith("/payments"):
        return web.Response(status=503, text="down")
    if path.startswith("/orders/fail"):
        return web.Response(status=503, text="down")
    if path.startswith("/orders/parked"):
        return web.Response(status=422 if request.headers.get("x-retry-replay") else 503)
    fail = 0.25 if path.startswith("/orders") else 0.1
    return web.Response(status=503 if random.random() < fail else 200, text="ok")


async def main(out: Path) -> None:
    reason = why_not()
    if reason:
        raise SystemExit(f"cannot take the screenshot: {reason}")
    random.seed(7)
    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", upstream)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    up = f"http://127.0.0.1:{runner.addresses[0][1]}"
    with tempfile.TemporaryDirectory() as tmp:
        import time

        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + 2 * 3600 + 900))
        os.environ["SCREENSHOT_ADMIN_TOKEN"] = token = secrets.token_urlsafe(16)
        text = POLICY.format(db=f"{tmp}/dlq.sqlite3", up=up, until=until)
        sc = Sidecar(parse_text(text, "/etc/retry-sidecar/sidecar.yaml"))
        await sc.start()
        proxy = f"http://127.0.0.1:{sc.proxy_port}"
        admin = f"http://127.0.0.1:{sc.admin_port}"
        try:
            async with aiohttp.ClientSession() as s:

                async def hit(method: str, path: str) -> None:
                    async with s.request(method, proxy + path, data=b"{}") as r:
                        await r.read()

                for i in range(240):  # about 8 seconds of traffic
                    await asyncio.sleep(0.03)
                    await asyncio.gather(
                        hit("GET", f"/orders/{i}"),
                        hit("GET", f"/catalog/{i}"),
                        hit("GET", f"/catalog/item/{i}"),
                        hit("GET", f"/payments/{i}") if i % 3 == 0 else asyncio.sleep(0),
                    )
                for i in range(3):
                    await hit("PUT", f"/orders/fail/{i}")
                async with s.put(proxy + "/orders/parked", data=b"{}") as r:
                    rid = r.headers["x-retry-dlq-id"]
                auth = {"Authorization": f"Bearer {token}"}
                async with s.post(f"{admin}/dlq/{rid}/replay", headers=auth) as r:
                    await r.read()
            async with browser(Path(tmp) / "profile", width=1360, height=760) as ctx:
                page = await ctx.new_page()
                await page.goto(admin + "/?refresh=0")
                await page.screenshot(path=str(out), full_page=True)
        finally:
            await sc.stop()
            await runner.cleanup()
    print(f"wrote {out}")


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs/status-page.png")))

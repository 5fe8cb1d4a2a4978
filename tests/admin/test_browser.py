"""The status page in a real browser (Debian's chromium, driven by Playwright, JavaScript OFF):
read it, act through its forms, check the effect through the admin API. Skips with the reason
when Playwright or chromium is missing."""

from __future__ import annotations

import re

import aiohttp
import pytest

from tests.browser import browser, why_not
from tests.conftest import reply, routes_yaml
from tests.proc import SidecarProcess, free_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(why_not() is not None, reason=str(why_not())),
]

TOKEN = "browser-test-token-7f3a9c"


async def test_read_act_and_check_in_a_real_browser(upstream_factory, tmp_path):
    up = await upstream_factory(reply(503))
    port, admin = free_port(), free_port()
    base = f"http://127.0.0.1:{admin}"
    text = routes_yaml(
        up.url,
        "    match: {path_prefix: /orders}\n    dlq: {enabled: true}\n"
        "    breaker: {min_sequences: 100000}\n"
        "    throttle: {enabled: false}\n"  # every retry of an always-503 upstream is counted
        "  - name: catalog\n"
        f'    upstream: "{up.url}"',
        top_extra=f'dlq: {{path: "{tmp_path / "dlq.sqlite3"}"}}',
        admin=f'admin: {{listen: "127.0.0.1:{admin}", token_env: TEST_ADMIN_TOKEN}}',
    )
    text = text.replace('listen: "127.0.0.1:0"', f'listen: "127.0.0.1:{port}"', 1)
    text = text.replace("- name: main", "- name: orders")
    cfg = tmp_path / "sidecar.yaml"
    cfg.write_text(text)
    proc = SidecarProcess(cfg, env={"TEST_ADMIN_TOKEN": TOKEN})
    proc.start()
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        await proc.wait_port(port, admin)
        async with aiohttp.ClientSession() as api:
            # Traffic, and one parked DLQ record (stored on 503, replayed into a 400).
            for i in range(5):
                async with api.get(f"http://127.0.0.1:{port}/orders/{i}") as r:
                    await r.read()
            async with api.put(f"http://127.0.0.1:{port}/orders/9", data=b"v") as r:
                rid = r.headers["x-retry-dlq-id"]
            up.script = [reply(400)]
            async with api.post(f"{base}/dlq/{rid}/replay", headers=auth) as r:
                assert (await r.json())["status"] == "parked"
            up.script = [reply(503)]

            async with browser(tmp_path / "profile") as ctx:
                seen: list[str] = []
                ctx.on("request", lambda req: seen.append(req.url))
                page = await ctx.new_page()
                page.set_default_timeout(10_000)

                # -- see ------------------------------------------------------------------
                await page.goto(base + "/?refresh=2")
                orders = await page.inner_text("#route-orders")
                assert "orders" in orders and "exhausted 6" in orders  # 5 GETs and the PUT
                assert "1 parked" in orders and "closed" in orders
                assert "None active" in await page.inner_text("#switches")
                # The page refreshes itself (a meta refresh: no JavaScript is running here).
                async with page.expect_navigation(timeout=10_000):
                    pass

                # -- switch retries off for the route ---------------------------------------
                await page.goto(base + "/?refresh=0")
                await page.click("#route-orders >> text=switch off retries")
                assert page.url == base + "/ui/killswitch?scope=route%3Aorders"
                assert await page.input_value("#scope") == "route:orders"
                await page.fill("#ttl", "10m")
                await page.fill("#reason", "INC-77 retries amplify")
                await page.fill("#token", "not-the-token")
                await page.click("button[type=submit]")
                assert "token is wrong" in await page.inner_text("#form-error")
                assert await page.input_value("#reason") == "INC-77 retries amplify"
                async with api.get(base + "/killswitch") as r:
                    assert (await r.json())["switches"] == []  # nothing happened
                await page.fill("#token", TOKEN)
                await page.click("button[type=submit]")
                assert re.fullmatch(re.escape(base) + r"/\?done=\d+", page.url)
                assert "Retries are off for route:orders" in await page.inner_text("#notice")

                # -- watch the effect, through the API and the proxy ------------------------
                async with api.get(base + "/killswitch") as r:
                    [sw] = (await r.json())["switches"]
                assert (sw["scope"], sw["source"], sw["reason"]) == (
                    "route:orders",
                    "admin",
                    "INC-77 retries amplify",
                )
                async with api.get(f"http://127.0.0.1:{port}/orders/x") as r:
                    assert r.headers["x-retry-fate"] == "kill-switch"
                await page.goto(base + "/?refresh=0")
                assert "INC-77 retries amplify" in await page.inner_text("#route-orders")
                assert "kill-switch 1" in await page.inner_text("#route-orders")
                await page.screenshot(path=str(tmp_path / "status-page.png"), full_page=True)

                # -- replay the parked record ------------------------------------------------
                up.script = [reply(200)]
                await page.click("#route-orders >> text=replay parked")
                await page.fill("#token", TOKEN)
                await page.click("button[type=submit]")
                assert "1 delivered" in await page.inner_text("#notice")
                async with api.get(f"{base}/dlq/{rid}", headers=auth) as r:
                    assert (await r.json())["status"] == "delivered"

                # -- lift -----------------------------------------------------------------
                await page.click("#switches >> text=lift")
                await page.fill("#token", TOKEN)
                await page.click("button[type=submit]")
                assert "Lifted the route:orders kill switch" in await page.inner_text("#notice")
                async with api.get(base + "/killswitch") as r:
                    assert (await r.json())["switches"] == []

                # The token never was in a URL, a page or a cookie.
                assert seen and not [u for u in seen if TOKEN in u]
                assert TOKEN not in await page.content()
                assert await ctx.cookies() == []
    finally:
        assert proc.terminate() == 0

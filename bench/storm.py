"""Scripted outage against a three-tier chain, retry-sidecar vs naive retries at every tier.

    client -> sidecar 1 -> app 1 -> sidecar 2 -> app 2 -> sidecar 3 -> bottom service

The bottom service fails 100% (503) for --outage seconds, then recovers for --recovery seconds,
under steady client traffic (--rate requests/s). For each mode it prints calls reaching the
bottom per client request during the outage, goodput after recovery, and the time from recovery
until the client success rate (1 s sliding window) is back above 99%.

Modes: "retry-sidecar" = edge-only marking, budget and breaker as configured below;
"naive" = the same three sidecars with the marker ignored (no trusted peers), no budget
and no breaker, i.e. every tier retries on its own. Everything runs in this process, on
loopback, bounded in time, and stops by itself.

    python3 bench/storm.py [--rate 50] [--outage 5] [--recovery 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from sidecar.app import Sidecar
from sidecar.config.parse import parse_text

PROPAGATED = ("x-retry-edge", "x-request-timeout-ms", "tracestate")


@dataclass(frozen=True)
class Mode:
    name: str
    edge_marking: bool
    budget: bool
    breaker: bool


MODES = (
    Mode("retry-sidecar", True, True, True),
    Mode("edge+budget", True, True, False),
    Mode("naive", False, False, False),
)
BREAKER = "{failure_ratio: 0.5, min_sequences: 20, window: 5s, open_for: 1s, half_open_probes: 3}"


def sidecar_yaml(upstream: int, mode: Mode) -> str:
    trusted = '["127.0.0.0/8"]' if mode.edge_marking else '["10.255.255.0/24"]'
    budget = "{ratio: 0.2, min_per_second: 5}" if mode.budget else "{ratio: 1000}"
    breaker = BREAKER if mode.breaker else "{min_sequences: 1000000}"
    return f"""
version: 1
name: {mode.name}
listen: "127.0.0.1:0"
trusted_peers: {trusted}
defaults:
  timeout: 5s
  retry:
    attempts: 3
    per_try_timeout: 1s
    backoff: {{strategy: full_jitter, base: 20ms, max: 200ms}}
  budget: {budget}
  breaker: {breaker}
routes:
  - name: next
    upstream: "http://127.0.0.1:{upstream}"
"""


@dataclass
class Bottom:
    failing: bool = True
    calls: int = 0


async def start(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, int(runner.addresses[0][1])


def bottom_app(state: Bottom) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        state.calls += 1
        if state.failing:
            return web.Response(status=503, text="down")
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/{t:.*}", handle)
    return app


def relay_app(next_port: int, session_box: list[aiohttp.ClientSession]) -> web.Application:
    async def handle(request: web.Request) -> web.Response:
        headers = {h: request.headers[h] for h in PROPAGATED if h in request.headers}
        try:
            async with session_box[0].get(
                f"http://127.0.0.1:{next_port}{request.path}", headers=headers
            ) as resp:
                await resp.read()
                return web.Response(status=resp.status)
        except aiohttp.ClientError:
            return web.Response(status=502)

    app = web.Application()
    app.router.add_get("/{t:.*}", handle)
    return app


@dataclass
class Result:
    mode: str
    client_requests_outage: int = 0
    bottom_calls_outage: int = 0
    ok_after: int = 0
    sent_after: int = 0
    recovery_seconds: float | None = None
    outcomes: list[tuple[float, bool]] = field(default_factory=list)


async def run_mode(mode: Mode, rate: float, outage: float, recovery: float) -> Result:
    res = Result(mode.name)
    bottom = Bottom()
    runners: list[web.AppRunner] = []
    sidecars: list[Sidecar] = []
    # Apps keep their client connections (no force_close) but aiohttp's silent resend only
    # happens on a broken keep-alive connection, which the sidecars never produce here.
    session_box: list[aiohttp.ClientSession] = [aiohttp.ClientSession()]
    try:
        r, port = await start(bottom_app(bottom))
        runners.append(r)
        for _ in range(2):
            sc = Sidecar(parse_text(sidecar_yaml(port, mode), "<storm>"))
            await sc.start()
            sidecars.append(sc)
            r, port = await start(relay_app(sc.proxy_port, session_box))
            runners.append(r)
        edge = Sidecar(parse_text(sidecar_yaml(port, mode), "<storm>"))
        await edge.start()
        sidecars.append(edge)
        url = f"http://127.0.0.1:{edge.proxy_port}/work"

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as client:
            tasks: list[asyncio.Task[None]] = []
            t0 = time.monotonic()
            recovered_at = t0 + outage
            end = recovered_at + recovery

            async def one(sent_at: float) -> None:
                try:
                    async with client.get(url) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                res.outcomes.append((sent_at, ok))

            i = 0
            while True:
                now = time.monotonic()
                if now >= end:
                    break
                if bottom.failing and now >= recovered_at:
                    res.bottom_calls_outage = bottom.calls
                    res.client_requests_outage = i
                    bottom.failing = False
                tasks.append(asyncio.create_task(one(now - t0)))
                i += 1
                await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            await asyncio.gather(*tasks)
        after = [ok for t, ok in res.outcomes if t >= outage]
        res.sent_after = len(after)
        res.ok_after = sum(after)
        res.recovery_seconds = recovery_time(res.outcomes, outage)
    finally:
        for sc in sidecars:
            await sc.stop()
        await session_box[0].close()
        for r in runners:
            await r.cleanup()
    return res


def recovery_time(outcomes: list[tuple[float, bool]], recovered_at: float) -> float | None:
    """Seconds after recovery until every later 1 s window of sent requests is >= 99% ok."""
    after = sorted((t, ok) for t, ok in outcomes if t >= recovered_at)
    if not after:
        return None
    last_bad = None
    for t, ok in after:
        if not ok:
            last_bad = t
    if last_bad is None:
        return 0.0
    # windows ending after the last failure are 100% ok; find the first 1 s window start from
    # which the rate stays above 99%.
    starts = [t for t, _ in after]
    for s in starts:
        window = [ok for t, ok in after if s <= t < s + 1.0]
        tail_ok = all(ok for t, ok in after if t >= s + 1.0)
        if window and sum(window) / len(window) >= 0.99 and tail_ok:
            return s - recovered_at
    return None


async def run_all(args: argparse.Namespace) -> list[dict[str, object]]:
    results = []
    for mode in MODES:
        results.append(await run_mode(mode, args.rate, args.outage, args.recovery))
    print(
        f"3-tier chain, attempts 3 per tier, {args.rate:g} req/s, "
        f"{args.outage:g}s outage then {args.recovery:g}s recovered\n"
    )
    hdr = (
        f"{'mode':<15}{'bottom calls/req (outage)':>27}{'goodput after (req/s)':>23}"
        f"{'success after':>15}{'time to >99% ok':>17}"
    )
    print(hdr)
    print("-" * len(hdr))
    out = []
    for r in results:
        per_req = r.bottom_calls_outage / max(1, r.client_requests_outage)
        goodput = r.ok_after / args.recovery
        succ = 100.0 * r.ok_after / max(1, r.sent_after)
        rec = "never" if r.recovery_seconds is None else f"{r.recovery_seconds:.2f}s"
        print(f"{r.mode:<15}{per_req:>27.2f}{goodput:>23.1f}{succ:>14.1f}%{rec:>17}")
        out.append(
            {
                "mode": r.mode,
                "bottom_calls_per_request": per_req,
                "goodput": goodput,
                "success_after_pct": succ,
                "recovery_seconds": r.recovery_seconds,
            }
        )
    return out


def main() -> None:
    import uvloop

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rate", type=float, default=50.0, help="client requests per second")
    ap.add_argument("--outage", type=float, default=5.0, help="seconds of 100%% failure")
    ap.add_argument("--recovery", type=float, default=6.0, help="seconds after recovery")
    ap.add_argument("--json", help="also write the figures to this file")
    args = ap.parse_args()
    out = uvloop.run(run_all(args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()

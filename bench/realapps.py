"""Real apps three ways in one run: direct, through retry-sidecar with its shipped defaults
(only listen, admin listen, a DLQ path and one route), and through nginx as a reverse proxy.

    python3 -m bench.realapps                  # every workload, about 3 minutes
    python3 -m bench.realapps --only git,longpoll

Workloads (each against a fresh app per way; everything stops by itself):
  git        dulwich's smart-HTTP server under gunicorn: git push and clone of a 20 MiB blob
  s3-sqs     moto's server driven by boto3: objects, a 15 MiB multipart upload, an SQS queue
  socketio   a Socket.IO session over HTTP long-polling: 40 echoes, then 10 pushed ticks
  longpoll   250 long-poll clients (1.5 s per poll) and one fast client, for 15 s
  sync1      ten sequential 0.5 s GETs against gunicorn's single sync worker

The table gives, per workload and way: requests (or client operations) answered, refused or
failed, handler runs the app counted, and the wall time as a ratio to direct.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
from aiohttp import web

from tests import gitapp, motoapp, sioapp
from tests.difftools import stop
from tests.proc import free_port
from tests.realapp import start_single_worker_app
from tests.threeways import WAYS, Tally, front, nginx_available

LONGPOLL_CLIENTS = 250
LONGPOLL_SECONDS = 15.0
LONGPOLL_HOLD = 1.5
SYNC1_GETS = 10
SYNC1_MS = 500

Workload = Callable[[str, Path], Awaitable[Tally]]


async def git(way: str, tmp: Path) -> Tally:
    commit_file = tmp / "commit"
    if not commit_file.exists():
        commit_file.write_text(gitapp.make_source(tmp))
    port = free_port()
    app = gitapp.start(port, tmp / f"server-{way}")
    try:
        async with front(way, port, tmp / f"front-{way}") as p:
            return await asyncio.to_thread(
                gitapp.run, f"http://127.0.0.1:{p}", port, tmp, commit_file.read_text()
            )
    finally:
        stop(app)


async def s3_sqs(way: str, tmp: Path) -> Tally:
    port = free_port()
    app = motoapp.start(port)
    try:
        async with front(way, port, tmp / f"front-{way}") as p:
            return await asyncio.to_thread(motoapp.run, f"http://127.0.0.1:{p}", port)
    finally:
        stop(app)


async def socketio(way: str, tmp: Path) -> Tally:
    async with (
        sioapp.server() as (port, counts),
        front(way, port, tmp / f"front-{way}") as p,
    ):
        return await sioapp.run(f"http://127.0.0.1:{p}", counts)


async def longpoll(way: str, tmp: Path) -> Tally:
    """As a chat or notification app: every poll is held LONGPOLL_HOLD s; one fast client
    beside the pollers asks every 20 ms."""
    seen: Counter[str] = Counter()

    async def poll(request: web.Request) -> web.Response:
        seen["poll"] += 1
        await asyncio.sleep(LONGPOLL_HOLD)
        return web.Response(text="event")

    async def fast(request: web.Request) -> web.Response:
        seen["fast"] += 1
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/poll", poll)
    app.router.add_get("/fast", fast)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=1024).start()
    statuses: Counter[str] = Counter()
    try:
        async with front(way, int(runner.addresses[0][1]), tmp / f"front-{way}") as p:
            t0 = time.monotonic()
            until = t0 + LONGPOLL_SECONDS

            async def loop(client: aiohttp.ClientSession, path: str, pause: float) -> None:
                while time.monotonic() < until:
                    try:
                        async with client.get(f"http://127.0.0.1:{p}{path}") as r:
                            await r.read()
                            statuses["ok" if r.status == 200 else f"{path} {r.status}"] += 1
                    except (aiohttp.ClientError, TimeoutError) as exc:
                        statuses[f"{path} {type(exc).__name__}"] += 1
                        await asyncio.sleep(0.1)  # a refused connection must not spin
                    await asyncio.sleep(pause)

            conn = aiohttp.TCPConnector(limit=0)
            timeout = aiohttp.ClientTimeout(total=30)
            async with aiohttp.ClientSession(connector=conn, timeout=timeout) as client:
                await asyncio.gather(
                    *(loop(client, "/poll", 0) for _ in range(LONGPOLL_CLIENTS)),
                    loop(client, "/fast", 0.02),
                )
            seconds = time.monotonic() - t0
    finally:
        await runner.cleanup()
    refused = {k: n for k, n in statuses.items() if k != "ok"}
    return Tally(
        outcome={"refused": refused},
        answered=statuses["ok"],
        refused=sum(refused.values()),
        handled=dict(seen),
        seconds=seconds,
    )


async def sync1(way: str, tmp: Path) -> Tally:
    """gunicorn's defaults: one sync worker. Ten slow GETs one after the other."""
    port = free_port()
    app = start_single_worker_app(port)
    answered, failed = 0, []
    try:
        async with front(way, port, tmp / f"front-{way}") as p, aiohttp.ClientSession() as client:
            t0 = time.monotonic()
            for _ in range(SYNC1_GETS):
                async with client.get(f"http://127.0.0.1:{p}/slow?ms={SYNC1_MS}") as r:
                    if r.status == 200 and await r.read() == b"done":
                        answered += 1
                    else:
                        failed.append(r.status)
            seconds = time.monotonic() - t0
            # Straight to the app, after any duplicate left queued in its one worker.
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/count", timeout=30) as r:
                handled: dict[str, int] = json.loads(r.read())
    finally:
        stop(app)
    return Tally(
        outcome={"failed": failed},
        answered=answered,
        refused=len(failed),
        handled=handled,
        seconds=seconds,
    )


WORKLOADS: dict[str, Workload] = {
    "git": git,
    "s3-sqs": s3_sqs,
    "socketio": socketio,
    "longpoll": longpoll,
    "sync1": sync1,
}
TITLES = {
    "git": "git push + clone, 20 MiB blob",
    "s3-sqs": "S3 + SQS on moto (boto3)",
    "socketio": "Socket.IO over long-polling",
    "longpoll": f"{LONGPOLL_CLIENTS} long-polls + 1 fast, {LONGPOLL_SECONDS:.0f} s",
    "sync1": f"{SYNC1_GETS} x {SYNC1_MS} ms GET, 1 sync worker",
}


def print_table(rows: dict[str, dict[str, Tally]], ways: list[str]) -> None:
    widths = [36, 16] + [16] * len(ways)
    header = ["workload", "figure", *ways]
    line = "".join(
        h.ljust(w) if i < 2 else h.rjust(w)
        for i, (h, w) in enumerate(zip(header, widths, strict=True))
    )
    print()
    print(line)
    print("-" * len(line))
    for key, tallies in rows.items():
        direct = tallies.get("direct")
        base = direct.seconds if direct else 0.0

        def wall(t: Tally, base: float = base) -> str:
            return f"{t.seconds:.1f}s (x{t.seconds / base:.2f})" if base else f"{t.seconds:.1f}s"

        figures: list[tuple[str, Callable[[Tally], str]]] = [
            ("answered", lambda t: str(t.answered)),
            ("refused/failed", lambda t: str(t.refused)),
            ("handler runs", lambda t: str(t.handler_runs)),
            ("wall time", wall),
        ]
        for j, (name, show) in enumerate(figures):
            cells = [show(tallies[w]) if w in tallies else "-" for w in ways]
            print(
                (TITLES[key] if j == 0 else "").ljust(widths[0])
                + name.ljust(widths[1])
                + "".join(c.rjust(w) for c, w in zip(cells, widths[2:], strict=True))
            )
        differs = [
            w for w in ways[1:] if direct and w in tallies and tallies[w].outcome != direct.outcome
        ]
        if differs:
            print(" " * widths[0] + f"outcome differs from direct: {', '.join(differs)}")


async def main_async(only: list[str], ways: list[str]) -> dict[str, dict[str, Tally]]:
    rows: dict[str, dict[str, Tally]] = {}
    with tempfile.TemporaryDirectory(prefix="realapps-") as tmp:
        for key in only:
            rows[key] = {}
            (Path(tmp) / key).mkdir()
            for way in ways:
                print(f"{key}: {way}", flush=True)
                rows[key][way] = await WORKLOADS[key](way, Path(tmp) / key)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", help="comma-separated workloads: " + ",".join(WORKLOADS))
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    only = args.only.split(",") if args.only else list(WORKLOADS)
    unknown = set(only) - set(WORKLOADS)
    if unknown:
        sys.exit(f"unknown workload(s) {', '.join(sorted(unknown))}")
    ways = [w for w in WAYS if w != "nginx" or nginx_available()]
    if "nginx" not in ways:
        print("nginx is not installed: its column is left out", file=sys.stderr)
    rows = asyncio.run(main_async(only, ways))
    print_table(rows, ways)
    if args.json:
        doc = {
            k: {w: {**vars(t), "handler_runs": t.handler_runs} for w, t in v.items()}
            for k, v in rows.items()
        }
        Path(args.json).write_text(json.dumps(doc, indent=2, default=str))


if __name__ == "__main__":
    main()

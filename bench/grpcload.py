"""gRPC unary load, and the gRPC rows of bench/perf.py: calls per second and the proxy's CPU per
call, with no proxy, through nginx's ``grpc_pass`` and through the sidecar.

    python3 -m bench.grpcload [--duration 5] [--rates 1000,2000] [--target HOST:PORT]
    python3 -m bench.grpcload load --target HOST:PORT [--duration 5 | --count N] [--rate R]
    python3 -m bench.grpcload serve --port PORT

With no subcommand it starts its own upstream (``serve``: a grpc.aio server answering
``/test.Echo/Unary`` with the request, pinned to the load CPU) and nginx (``listen ... http2``
with ``grpc_pass``, pinned to the proxy CPU), measures the rows "grpc direct" and "grpc nginx
grpc_pass" (plus "grpc target" for ``--target``, a proxy already running in front of some
upstream: its CPU is not measured) and prints them. ``load`` is the load generator alone: a
grpcio aio client, ``--concurrency`` calls in flight over ``--channels`` channels (each its own
HTTP/2 connection: a local subchannel pool), for a fixed duration or count, at full speed or at
``--rate`` calls/s; it prints one JSON line. It runs in a child process pinned to the load CPU,
so its own CPU is never counted as the proxy's.

How bench/perf.py adds the rows (its existing rows unchanged), in ``main`` after its proxies:

    from bench import grpcload
    targets = grpcload.start_arms(d, procs)   # upstream + nginx grpc_pass, in procs: stopped
    sidecar = Proc("grpc sidecar", p_gs)      # a sidecar whose route has upstream_protocol: h2
    procs.append(sidecar)                     # and upstream: http://127.0.0.1:<targets[0].port>
    start_into(sidecar, grpcload.sidecar_command(d, p_gs, a_gs, targets[0].port), PROXY_CPU, ...)
    targets.append(grpcload.Target("grpc sidecar", p_gs, sidecar))
    grpcload.add_rows(res, targets, args.duration, rounds)   # rows and keys below

Keys per row (``perf.Results``): ``grpc_peak_calls_s`` (full speed, 64 calls in flight over 4
connections), ``grpc_peak_cpu_us`` and, per rate, ``grpc_r{rate}_calls_s`` and
``grpc_r{rate}_cpu_us``: the proxy's CPU (utime + stime of the process and its children, from
/proc/PID/stat, as perf.py's HTTP rows) per completed call; ``grpc_errors``: calls not OK.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from bench.perf import (
    LOAD_CPU,
    PROXY_CPU,
    Proc,
    Results,
    free_port,
    nginx_command,
    pin,
    start_into,
)

METHOD = "/test.Echo/Unary"
PAYLOAD = b"x" * 100  # as perf.py's ~100-byte replies
RATES = (1000, 2000)
CONCURRENCY, CHANNELS = 64, 4
ROOT = Path(__file__).resolve().parents[1]
CHANNEL_OPTIONS = [("grpc.enable_retries", 0), ("grpc.use_local_subchannel_pool", 1)]


@dataclass
class Target:
    """A row: its name, the port calls go to, the process whose CPU is measured (None: none)."""

    name: str
    port: int
    proc: Proc | None = None


# -- the upstream -----------------------------------------------------------------------------


async def _serve(port: int) -> None:
    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    handler = grpc.method_handlers_generic_handler(
        "test.Echo", {"Unary": grpc.unary_unary_rpc_method_handler(echo)}
    )
    server.add_generic_rpc_handlers((handler,))
    if not server.add_insecure_port(f"127.0.0.1:{port}"):
        raise OSError(f"cannot bind 127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0.5)


# -- the load generator -----------------------------------------------------------------------


async def load(
    target: str,
    duration: float = 5.0,
    *,
    count: int | None = None,
    rate: float | None = None,
    concurrency: int = CONCURRENCY,
    channels: int = CHANNELS,
) -> dict[str, Any]:
    """Unary calls to ``target`` for ``duration`` s (or ``count`` calls, bounded by
    ``duration`` all the same), ``concurrency`` in flight over ``channels`` connections, at
    ``rate`` calls/s (None: as fast as they complete). Returns calls (OK), errors by code,
    seconds, calls_s."""
    chans = [grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) for _ in range(channels)]
    stubs = [c.unary_unary(METHOD) for c in chans]
    codes: Counter[str] = Counter()
    started = 0
    try:
        for stub in stubs:  # connect (and warm) every channel before the clock starts
            await stub(PAYLOAD, timeout=10)
        t0 = time.monotonic()
        end = t0 + duration

        async def worker(i: int) -> None:
            nonlocal started
            stub = stubs[i % len(stubs)]
            while True:
                n = started
                if (count is not None and n >= count) or time.monotonic() >= end:
                    return
                started += 1
                if rate is not None:
                    wait = t0 + n / rate - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                try:
                    await stub(PAYLOAD, timeout=10)
                    codes["OK"] += 1
                except grpc.aio.AioRpcError as e:
                    codes[e.code().name] += 1

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        seconds = time.monotonic() - t0
    finally:
        for c in chans:
            await c.close()
    ok = codes.pop("OK", 0)
    return {"calls": ok, "errors": dict(codes), "seconds": seconds, "calls_s": ok / seconds}


def run_load(port: int, duration: float, rate: float | None = None) -> dict[str, Any]:
    """``load`` in a child process pinned to the load CPU; bounded (killed past the duration
    plus 60 s)."""
    cmd = [sys.executable, "-m", "bench.grpcload", "load", "--target", f"127.0.0.1:{port}"]
    cmd += ["--duration", str(duration)] + (["--rate", str(rate)] if rate else [])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        cmd, capture_output=True, timeout=duration + 60, preexec_fn=pin(LOAD_CPU), env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"grpcload load failed: {out.stderr.decode()[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.decode().strip().splitlines()[-1])
    return result


# -- the rows ---------------------------------------------------------------------------------


def nginx_grpc_proxy(d: Path, port: int, up: int) -> list[str]:
    """nginx with h2c prior knowledge on ``port`` and grpc_pass to ``up``, keep-alive."""
    body = f"""
  upstream grpc_up {{ server 127.0.0.1:{up}; keepalive 64; }}
  server {{
    listen 127.0.0.1:{port} http2 backlog=4096;
    location / {{ grpc_pass grpc://grpc_up; }}
  }}"""
    return nginx_command(d, "grpc-proxy", body)


def start_arms(d: Path, procs: list[Proc]) -> list[Target]:
    """The gRPC upstream (on the load CPU) and nginx grpc_pass in front of it (on the proxy
    CPU), each appended to ``procs`` as soon as it exists (the caller stops them, by PID):
    [grpc direct, grpc nginx grpc_pass]. The upstream's port is ``[0].port``."""
    up = Proc("grpc upstream", free_port())
    procs.append(up)
    serve = [sys.executable, "-m", "bench.grpcload", "serve", "--port", str(up.port)]
    start_into(up, serve, LOAD_CPU, d / "grpc-up.log", ROOT)
    ngx = Proc("grpc nginx grpc_pass", free_port())
    procs.append(ngx)
    start_into(ngx, nginx_grpc_proxy(d, ngx.port, up.port), PROXY_CPU, d / "grpc-nginx.log")
    return [Target("grpc direct", up.port), Target(ngx.name, ngx.port, ngx)]


def sidecar_command(d: Path, port: int, admin: int, up: int) -> list[str]:
    """The sidecar (shipped defaults) with one route to the gRPC upstream over h2c."""
    conf = d / "grpc-sidecar.yaml"
    conf.write_text(f"""
version: 1
name: bench-grpc
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
routes:
  - name: grpc
    upstream: "http://127.0.0.1:{up}"
    upstream_protocol: h2
""")
    return [sys.executable, "-m", "sidecar", "run", "--config", str(conf), "--log-level", "warning"]


def _measured(res: Results, t: Target, key: str, duration: float, rate: float | None) -> None:
    cpu0 = t.proc.cpu_seconds() if t.proc else 0.0
    got = run_load(t.port, duration, rate)
    cpu1 = t.proc.cpu_seconds() if t.proc else 0.0
    res.add(t.name, f"{key}_calls_s", got["calls_s"])
    res.add(t.name, "grpc_errors", float(sum(got["errors"].values())))
    if t.proc and got["calls"]:
        res.add(t.name, f"{key}_cpu_us", (cpu1 - cpu0) * 1e6 / got["calls"])


def add_rows(
    res: Results,
    targets: list[Target],
    duration: float,
    rounds: int = 1,
    rates: tuple[int, ...] = RATES,
) -> None:
    """Measure every target, alternating (A B C A B C), ``rounds`` times: peak, then each rate."""
    for t in targets:  # warm up
        run_load(t.port, 1.0)
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}: gRPC unary", flush=True)
        for t in targets:
            _measured(res, t, "grpc_peak", duration, None)
        for rate in rates:
            for t in targets:
                _measured(res, t, f"grpc_r{rate}", duration, rate)


def report(res: Results, targets: list[Target], rates: tuple[int, ...] = RATES) -> None:
    keys = ["grpc_peak_calls_s", "grpc_peak_cpu_us"]
    keys += [k for r in rates for k in (f"grpc_r{r}_calls_s", f"grpc_r{r}_cpu_us")]
    keys.append("grpc_errors")
    print(f"{'':<22}" + "".join(f"{k.removeprefix('grpc_'):>15}" for k in keys))
    for t in targets:
        print(f"{t.name:<22}" + "".join(f"{res.mean(t.name, k):>15.1f}" for k in keys))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("mode", nargs="?", choices=["rows", "load", "serve"], default="rows")
    ap.add_argument("--target", default=None, help="HOST:PORT (load; rows: an extra row)")
    ap.add_argument("--port", type=int, default=0, help="serve: the port")
    ap.add_argument("--duration", type=float, default=5.0)
    ap.add_argument("--count", type=int, default=None)
    ap.add_argument("--rate", type=float, default=None)
    ap.add_argument("--rates", default=",".join(map(str, RATES)))
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--concurrency", type=int, default=CONCURRENCY)
    ap.add_argument("--channels", type=int, default=CHANNELS)
    args = ap.parse_args()
    if args.mode == "serve":
        asyncio.run(_serve(args.port))
        return 0
    if args.mode == "load":
        got = asyncio.run(
            load(
                args.target,
                args.duration,
                count=args.count,
                rate=args.rate,
                concurrency=args.concurrency,
                channels=args.channels,
            )
        )
        print(json.dumps(got), flush=True)
        return 0
    d = Path(tempfile.mkdtemp(prefix="retry-sidecar-grpcload-"))
    procs: list[Proc] = []
    res = Results()
    rates = tuple(int(r) for r in args.rates.split(",") if r)
    try:
        targets = start_arms(d, procs)
        if args.target:
            targets.append(Target("grpc target", int(args.target.rsplit(":", 1)[1])))
        add_rows(res, targets, args.duration, args.rounds, rates)
    finally:
        for p in reversed(procs):
            p.stop()
    report(res, targets, rates)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

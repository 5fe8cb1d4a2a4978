"""The HTTP/2 and gRPC rows of bench/perf.py, in the same run as its HTTP/1.1 rows (which stay
as they are; these run only when asked):

- ``--grpc``: gRPC unary calls (bench/grpcload.py's grpcio load, 64 calls in flight over 4
  connections) with no proxy (``grpc direct``), through nginx's ``grpc_pass`` and through the
  sidecar (``grpc sidecar``: the compiled build, shipped defaults, one route with
  ``upstream_protocol: h2`` to the same grpc.aio upstream): calls/s at full speed and the proxy's
  CPU per call at 1,000 and 2,000 calls/s;
- ``--h2``: plain HTTP/2 GETs (``h2load -c 4 -m 16``) through nginx (``listen ... http2``,
  ``proxy_pass`` to the HTTP/1.1 upstream of the HTTP/1.1 rows, keep-alive) and through the
  sidecar (``h2 sidecar``: the compiled build, configured as ``sidecar-compiled``, in a process
  of its own so the HTTP/1.1 rows' process sees no HTTP/2) on its h2c listener (prior
  knowledge): requests/s at full speed and CPU per request at the same rates.

One round of each is measured after each round of the HTTP/1.1 rows, so every ratio pairs
figures of the same round; the report gives medians and (min-max) over the rounds, and the
ratios grpc sidecar / nginx, / direct and grpc sidecar / sidecar-compiled's HTTP/1.1 CPU per
request (aim: <= 2x, issue 32).
"""

from __future__ import annotations

import re
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench import grpcload
from bench.grpcload import Target
from bench.perf import (
    LOAD_CPU,
    PROXY_CPU,
    Proc,
    Results,
    free_port,
    nginx_command,
    sidecar,
    start_into,
)

GRPC_SIDECAR = "grpc sidecar"
H2_NGINX = "h2 nginx"
H2_SIDECAR = "h2 sidecar"
H1_SIDECAR = "sidecar-compiled"  # the HTTP/1.1 row the 2x aim is measured against
RATES = (1000, 2000)
H2_CLIENTS, H2_STREAMS = 4, 16  # h2load -c / -m: 64 streams in flight, as the gRPC load


@dataclass
class Arms:
    grpc: list[Target] = field(default_factory=list)
    h2: list[Target] = field(default_factory=list)


def nginx_h2_proxy(d: Path, port: int, up: int) -> list[str]:
    """nginx with h2c prior knowledge on ``port``, proxying over HTTP/1.1 to ``up``, keep-alive
    (as perf.py's ``nginx`` row)."""
    body = f"""
  upstream h2_up {{ server 127.0.0.1:{up}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port} http2 backlog=4096;
    location / {{
      proxy_pass http://h2_up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}"""
    return nginx_command(d, "proxy-h2", body)


def start(d: Path, procs: list[Proc], *, grpc: bool, h2: bool, up: int, tree: Path) -> Arms:
    """Start what the asked rows need, each appended to ``procs`` as soon as it exists (the
    caller stops them, by PID). ``up``: the HTTP/1.1 upstream; ``tree``: the compiled build the
    sidecars run from."""
    arms = Arms()
    here = str(Path(__file__).resolve().parent.parent)
    if grpc:
        arms.grpc = grpcload.start_arms(d, procs)
        sc = Proc(GRPC_SIDECAR, free_port())
        procs.append(sc)
        cmd = grpcload.sidecar_command(d, sc.port, free_port(), arms.grpc[0].port)
        start_into(sc, cmd, PROXY_CPU, d / "grpc-sidecar.log", tree, here)
        arms.grpc.append(Target(GRPC_SIDECAR, sc.port, sc))
    if h2:
        ngx = Proc(H2_NGINX, free_port())
        procs.append(ngx)
        start_into(ngx, nginx_h2_proxy(d, ngx.port, up), PROXY_CPU, d / "h2-nginx.log")
        arms.h2.append(Target(H2_NGINX, ngx.port, ngx))
        h2s = Proc(H2_SIDECAR, free_port())
        procs.append(h2s)
        cmd = sidecar(d, h2s.port, free_port(), up, "h2-sidecar")
        start_into(h2s, cmd, PROXY_CPU, d / "h2-sidecar.log", tree, here)
        arms.h2.append(Target(H2_SIDECAR, h2s.port, h2s))
    return arms


# -- h2load -----------------------------------------------------------------------------------


def h2load(port: int, duration: float, rate: int | None = None) -> dict[str, float]:
    """``h2load`` on the load CPU for ``duration`` s, ``H2_CLIENTS`` connections with
    ``H2_STREAMS`` streams each, at full speed or ``rate`` req/s in all."""
    cmd = ["taskset", "-c", str(LOAD_CPU), "h2load", f"-c{H2_CLIENTS}", f"-m{H2_STREAMS}"]
    cmd += ["-t1", f"-D{max(1, int(duration))}"]
    if rate is not None:
        cmd.append(f"--rps={max(1, rate // H2_CLIENTS)}")
    cmd.append(f"http://127.0.0.1:{port}/")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 60).stdout
    done = re.search(r"requests: \d+ total, \d+ started, (\d+) done, (\d+) succeeded", out)
    rps = re.search(r"finished in [\d.]+s, ([\d.]+) req/s", out)
    ok2xx = re.search(r"status codes: (\d+) 2xx", out)
    if done is None or rps is None or ok2xx is None:
        raise RuntimeError(f"h2load said: {out[-2000:]}")
    finished, good = float(done.group(1)), float(ok2xx.group(1))
    return {
        "requests": good,
        "errors": max(0.0, finished - good),  # failed, errored, timed out or not 2xx
        "req_s": float(rps.group(1)) * (good / finished if finished else 0.0),
    }


def _h2_measured(res: Results, t: Target, key: str, duration: float, rate: int | None) -> None:
    assert t.proc is not None
    cpu0 = t.proc.cpu_seconds()
    got = h2load(t.port, duration, rate)
    cpu1 = t.proc.cpu_seconds()
    res.add(t.name, f"{key}_req_s", got["req_s"])
    res.add(t.name, "h2_errors", got["errors"])
    if got["requests"]:
        res.add(t.name, f"{key}_cpu_us", (cpu1 - cpu0) * 1e6 / got["requests"])


def measure_round(res: Results, arms: Arms, duration: float) -> None:
    """One round of every asked row, alternating (A B C A B C): peak, then each rate."""
    if arms.grpc:
        grpcload.add_rows(res, arms.grpc, duration, 1, RATES)
    if arms.h2:
        print("  HTTP/2 (h2load)", flush=True)
        for t in arms.h2:
            _h2_measured(res, t, "h2_peak", duration, None)
        for rate in RATES:
            for t in arms.h2:
                _h2_measured(res, t, f"h2_r{rate}", duration, rate)


# -- the report -------------------------------------------------------------------------------


def _vals(res: Results, name: str, key: str) -> list[float]:
    v: list[float] = res.rows.get(name, {}).get(key, [])
    return v


def cell(values: list[float], fmt: str = ".0f") -> str:
    """``median (min-max)`` of a row's rounds."""
    if not values:
        return "-"
    med = statistics.median(values)
    if len(values) == 1:
        return f"{med:{fmt}}"
    return f"{med:{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def ratio_cell(res: Results, a: tuple[str, str], b: tuple[str, str]) -> str:
    """a / b, per round (the rows alternate within a round): median (min-max) of the ratios."""
    va, vb = _vals(res, *a), _vals(res, *b)
    per_round = [x / y for x, y in zip(va, vb, strict=False) if y]
    return cell(per_round, ".2f") + "x" if per_round else "-"


def _table(res: Results, names: list[str], rows: list[tuple[str, str, str]]) -> None:
    w = 26
    print(f"{'':<30}" + "".join(f"{n:>{w}}" for n in names))
    for label, key, fmt in rows:
        print(f"{label:<30}" + "".join(f"{cell(_vals(res, n, key), fmt):>{w}}" for n in names))


def report(res: Results, arms: Arms, say: Callable[[str], None] = print) -> None:
    """The rows (median (min-max) over the rounds) and the ratios, same rounds paired."""
    if arms.grpc:
        names = [t.name for t in arms.grpc]
        say("\ngRPC unary (grpcio, 64 calls in flight over 4 connections), median (min-max):")
        rows = [("calls/s, full speed", "grpc_peak_calls_s", ".0f")]
        rows.append(("CPU us/call, full speed", "grpc_peak_cpu_us", ".1f"))
        for r in RATES:
            rows.append((f"calls/s at {r}/s", f"grpc_r{r}_calls_s", ".0f"))
            rows.append((f"CPU us/call at {r}/s", f"grpc_r{r}_cpu_us", ".1f"))
        rows.append(("calls not OK (per run)", "grpc_errors", ".0f"))
        _table(res, names, rows)
        ng = arms.grpc[1].name
        say("\ngRPC ratios, per round (median (min-max)):")
        pairs = [
            ("calls/s full speed, sidecar / nginx", "grpc_peak_calls_s", (ng, "grpc_peak_calls_s")),
            (
                "calls/s full speed, sidecar / direct",
                "grpc_peak_calls_s",
                ("grpc direct", "grpc_peak_calls_s"),
            ),
        ]
        for r in RATES:
            k = f"grpc_r{r}_cpu_us"
            pairs.append((f"CPU/call at {r}/s, sidecar / nginx", k, (ng, k)))
            pairs.append(
                (f"CPU/call at {r}/s / own HTTP/1.1 (<= 2x)", k, (H1_SIDECAR, f"r{r}_cpu_us"))
            )
        for label, key, other in pairs:
            say(f"{label:<48}{ratio_cell(res, (GRPC_SIDECAR, key), other):>24}")
    if arms.h2:
        names = [t.name for t in arms.h2]
        say(
            f"\nHTTP/2 GET (h2load -c{H2_CLIENTS} -m{H2_STREAMS}; HTTP/1.1 upstream),"
            " median (min-max):"
        )
        rows = [("req/s, full speed", "h2_peak_req_s", ".0f")]
        rows.append(("CPU us/request, full speed", "h2_peak_cpu_us", ".1f"))
        for r in RATES:
            rows.append((f"req/s at {r}/s", f"h2_r{r}_req_s", ".0f"))
            rows.append((f"CPU us/request at {r}/s", f"h2_r{r}_cpu_us", ".1f"))
        rows.append(("not 2xx (per run)", "h2_errors", ".0f"))
        _table(res, names, rows)
        if len(arms.h2) == 2:
            say("\nHTTP/2 ratios, per round (median (min-max)):")
            pairs = [
                ("req/s full speed, sidecar / nginx", "h2_peak_req_s", (H2_NGINX, "h2_peak_req_s"))
            ]
            for r in RATES:
                k = f"h2_r{r}_cpu_us"
                pairs.append((f"CPU/request at {r}/s, sidecar / nginx", k, (H2_NGINX, k)))
                pairs.append(
                    (f"CPU/request at {r}/s / own HTTP/1.1", k, (H1_SIDECAR, f"r{r}_cpu_us"))
                )
            for label, key, other in pairs:
                say(f"{label:<48}{ratio_cell(res, (H2_SIDECAR, key), other):>24}")
    sys.stdout.flush()

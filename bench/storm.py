"""The storm benchmark: does a retrying proxy make an outage smaller or bigger?

    python3 bench/storm.py                       # every scenario, about 12 minutes
    python3 bench/storm.py --only 503-60,tail    # some of them
    python3 bench/storm.py --seconds 5 --json out.json

Real processes on loopback: a fault-injecting upstream (bench/faultd.py), and in front of it,
one after the other, nothing ("direct"), nginx, HAProxy and retry-sidecar with its shipped
defaults (with --adaptive also "sidecar+adaptive": a route that turns hedging and the adaptive
concurrency limit on); the same open-loop client load for each. The upstream's faults are a deterministic
function of (request id, attempt number as the upstream counts arrivals), so every product
meets the same pattern however it retries. Three-tier rows chain proxy -> app -> proxy -> app
-> proxy -> upstream, the apps being relays that propagate the retry headers as an
instrumented app does. Each scenario starts fresh processes; everything stops by itself.

Unless a row says "defaults", every product is configured as the issue's harness: 3 attempts,
1 s per try, about 3 s in all (nginx: proxy_next_upstream_tries 3, proxy_read_timeout 1s,
proxy_next_upstream_timeout 3s, the server listed three times so that it has a "next";
HAProxy: retries 2, retry-on conn-failure empty-response response-timeout 502 503 504,
timeout server 1s; retry-sidecar: retry {attempts: 3, per_try_timeout: 1s}, timeout 3s --
nothing else). "defaults" rows leave each product's timeouts as shipped (nginx 60 s, HAProxy
60 s as nginx since it has none, retry-sidecar's per_try_timeout auto and 60 s deadline); the
client then waits up to 65 s. The table gives each figure and its ratio to direct.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
PRODUCTS = ("direct", "nginx", "haproxy", "retry-sidecar")


@dataclass(frozen=True)
class Scenario:
    key: str
    title: str
    metrics: tuple[str, ...]
    fault: str = "ok"
    tiers: int = 1
    timeouts: str = "table"  # "table" (3 x 1 s, 3 s) or "defaults"
    method: str = "GET"
    keyed: bool = False
    outage: tuple[float, float] | None = None  # seconds into the load: ids sent then fail
    phases: tuple[tuple[float, float], ...] = ()  # (seconds, rate); empty: --seconds at --rate
    capacity: str | None = None
    rate_scale: float = 1.0


def scenarios(seconds: float, rate: float) -> list[Scenario]:
    s = seconds
    return [
        Scenario("503-60", "steady 60% 503", ("success",), fault="503:0.6"),
        Scenario("503-70", "steady 70% 503", ("success",), fault="503:0.7"),
        Scenario("503-40", "steady 40% 503", ("success", "calls"), fault="503:0.4"),
        Scenario("reset-30", "30% connection resets", ("success", "calls"), fault="reset:0.3"),
        Scenario(
            "slow-30",
            "30% slow replies (3 s), defaults",
            ("success", "p50"),
            fault="slow:0.3:3s",
            timeouts="defaults",
        ),
        Scenario(
            "retry-after", "50% 503 with Retry-After: 1", ("success", "calls"), fault="503ra:0.5"
        ),
        Scenario(
            "post-keyed",
            "50% 503, POST with Idempotency-Key",
            ("success", "calls"),
            fault="503:0.5",
            method="POST",
            keyed=True,
        ),
        Scenario(
            "post-keyless",
            "50% 503, POST without key",
            ("success", "calls"),
            fault="503:0.5",
            method="POST",
        ),
        Scenario(
            "outage-1",
            "5 s full outage, then healthy (1 tier)",
            ("recovery", "success"),
            outage=(10.0, 15.0),
            phases=((21.0, rate),),
        ),
        Scenario(
            "outage-3",
            "5 s full outage, then healthy (3 tiers)",
            ("recovery", "success"),
            tiers=3,
            outage=(10.0, 15.0),
            phases=((21.0, rate / 2),),
        ),
        Scenario(
            "down-3",
            "3-tier chain, full outage",
            ("outage-calls",),
            tiers=3,
            outage=(2.0, 2.0 + 2 * s),
            phases=((2.0 + 2 * s, rate / 5),),
        ),
        Scenario(
            "overload",
            "overload: 2x capacity for 20 s, then 0.5x",
            ("goodput", "recovery"),
            capacity="5:50ms",
            outage=None,
            phases=((20.0, 200.0), (10.0, 50.0)),
        ),
        Scenario(
            "tail",
            "2% of replies take 1 s, defaults",
            ("p99", "extra"),
            fault="slow:0.02:1s",
            timeouts="defaults",
        ),
    ]


# -- processes ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        return int(sk.getsockname()[1])


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        with socket.socket() as sk:
            if sk.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


class Procs:
    """Processes started for one run, stopped by PID (the group each leads)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, cmd: list[str], port: int) -> None:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115 - kept for the process
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.Popen(cmd, stdout=log, stderr=log, env=env, start_new_session=True)
        self.procs.append(p)
        wait_port(port, p)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


def faultd(procs: Procs, name: str, args: list[str]) -> int:
    port = free_port()
    procs.start(name, [sys.executable, "-m", "bench.faultd", *args, "--port", str(port)], port)
    return port


def nginx(procs: Procs, name: str, up: int, sc: Scenario) -> int:
    port = free_port()
    d = procs.workdir / name
    d.mkdir(exist_ok=True)
    servers = "\n".join(f"    server 127.0.0.1:{up} max_fails=0;" for _ in range(3))
    timeouts = ""
    if sc.timeouts == "table":
        timeouts = """
      proxy_connect_timeout 1s;
      proxy_read_timeout 1s;
      proxy_send_timeout 1s;
      proxy_next_upstream_timeout 3s;"""
    conf = d / "nginx.conf"
    conf.write_text(f"""
worker_processes 1;
daemon off;
pid {d}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {d}/cbt;
  proxy_temp_path {d}/pt;
  fastcgi_temp_path {d}/ft;
  uwsgi_temp_path {d}/ut;
  scgi_temp_path {d}/st;
  upstream up {{
{servers}
    keepalive 64;
  }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_next_upstream error timeout http_502 http_503 http_504;
      proxy_next_upstream_tries 3;{timeouts}
    }}
  }}
}}
""")
    procs.start(name, ["nginx", "-p", str(d), "-c", str(conf), "-e", str(d / "error.log")], port)
    return port


def haproxy(procs: Procs, name: str, up: int, sc: Scenario) -> int:
    port = free_port()
    conf = procs.workdir / f"{name}.cfg"
    server_timeout = "1s" if sc.timeouts == "table" else "60s"
    conf.write_text(f"""
global
  maxconn 4096
defaults
  mode http
  timeout connect 1s
  timeout client 70s
  timeout server {server_timeout}
  retries 2
  retry-on conn-failure empty-response response-timeout 502 503 504
  option http-keep-alive
frontend fe
  bind 127.0.0.1:{port}
  default_backend be
backend be
  http-reuse safe
  server s1 127.0.0.1:{up} maxconn 4000
""")
    procs.start(name, ["haproxy", "-f", str(conf), "-db"], port)
    return port


SIDECAR_SET: list[str] = []  # --sidecar-set: extra keys under defaults (tuning runs only)
# --adaptive: the column of a route that turns on everything that is opt-in and adaptive
ADAPTIVE = "sidecar+adaptive"
ADAPTIVE_ROUTE = ("hedge: {enabled: true}", "bulkhead: {adaptive: true}")


def sidecar(
    procs: Procs, name: str, up: int, sc: Scenario, route_keys: tuple[str, ...] = ()
) -> int:
    port, admin = free_port(), free_port()
    conf = procs.workdir / f"{name}.yaml"
    lines = []
    if sc.timeouts == "table":
        lines += ["  timeout: 3s", "  retry: {attempts: 3, per_try_timeout: 1s}"]
    lines += [f"  {x}" for x in SIDECAR_SET]
    defaults = "defaults:\n" + "\n".join(lines) + "\n" if lines else ""
    conf.write_text(
        f"""version: 1
name: {name}
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
dlq: {{path: "{procs.workdir / name}.dlq"}}
{defaults}routes:
  - name: r
    upstream: "http://127.0.0.1:{up}"
"""
        + "".join(f"    {k}\n" for k in route_keys)
    )
    cmd = [sys.executable, "-m", "sidecar", "run", "--config", str(conf), "--log-level", "warning"]
    procs.start(name, cmd, port)
    return port


def sidecar_adaptive(procs: Procs, name: str, up: int, sc: Scenario) -> int:
    return sidecar(procs, name, up, sc, ADAPTIVE_ROUTE)


PROXY = {"nginx": nginx, "haproxy": haproxy, "retry-sidecar": sidecar, ADAPTIVE: sidecar_adaptive}


def build_chain(procs: Procs, product: str, bottom: int, sc: Scenario) -> int:
    """The port the client talks to: the product over the bottom, tiers deep."""
    port = bottom
    for tier in range(sc.tiers, 0, -1):
        if product != "direct":
            port = PROXY[product](procs, f"{product}-{tier}", port, sc)
        if tier > 1:
            port = faultd(procs, f"app-{tier - 1}", ["relay", "--next", f"http://127.0.0.1:{port}"])
    return port


# -- load --------------------------------------------------------------------------------------


@dataclass
class Sample:
    sent: float  # seconds since the load started
    rid: int
    ok: bool
    latency: float
    fate: str


@dataclass
class Run:
    samples: list[Sample] = field(default_factory=list)
    calls: int = 0
    outage_calls: int = 0


def schedule(sc: Scenario, seconds: float, rate: float) -> list[tuple[float, int]]:
    phases = sc.phases or ((seconds, rate * sc.rate_scale),)
    out: list[tuple[float, int]] = []
    t0 = 0.0
    for length, r in phases:
        n = int(length * r)
        out.extend((t0 + i / r, 0) for i in range(n))
        t0 += length
    return [(t, i) for i, (t, _) in enumerate(out)]


def outage_ids(sc: Scenario, plan: list[tuple[float, int]]) -> tuple[int, int] | None:
    if sc.outage is None:
        return None
    a, b = sc.outage
    ids = [i for t, i in plan if a <= t < b]
    return (ids[0], ids[-1] + 1) if ids else None


async def load(port: int, plan: list[tuple[float, int]], sc: Scenario) -> list[Sample]:
    client_timeout = 4.0 if sc.timeouts == "table" else 65.0
    samples: list[Sample] = []
    # force_close: a new connection per request, so aiohttp never silently resends a request
    # on a reused connection that the upstream (through a proxy or directly) closed.
    conn = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=client_timeout)
    ) as session:
        # aiohttp resends an idempotent request once when the server closes the connection
        # without an answer: the client must make exactly one attempt, as a plain client does.
        session._retry_connection = False
        base = f"http://127.0.0.1:{port}/r/"

        async def one(sent: float, rid: int) -> None:
            headers = {}
            data = None
            if sc.method == "POST":
                data = b'{"order": ' + str(rid).encode() + b"}"
                headers["Content-Type"] = "application/json"
                if sc.keyed:
                    headers["Idempotency-Key"] = f"k-{rid}"
            start = time.monotonic()
            try:
                async with session.request(
                    sc.method, base + str(rid), data=data, headers=headers
                ) as r:
                    await r.read()
                    ok = 200 <= r.status < 300
                    fate = r.headers.get("x-retry-fate", str(r.status))
                    if "x-retry-proxy-error" in r.headers:
                        fate += "/" + r.headers["x-retry-proxy-error"]
            except (aiohttp.ClientError, TimeoutError) as exc:
                ok, fate = False, type(exc).__name__
            samples.append(Sample(sent, rid, ok, time.monotonic() - start, fate))

        tasks = []
        t0 = time.monotonic()
        for sent, rid in plan:
            delay = t0 + sent - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(sent, rid)))
        await asyncio.gather(*tasks)
    return samples


async def stats(port: int, reset: bool = False) -> dict[str, int]:
    async with aiohttp.ClientSession() as s:
        path = "/__reset" if reset else "/__stats"
        async with s.post(f"http://127.0.0.1:{port}{path}") as r:
            data: dict[str, int] = await r.json()
            return data


# -- figures -----------------------------------------------------------------------------------


def recovery_time(samples: list[Sample], healthy_from: float) -> float | None:
    """Seconds after ``healthy_from`` until every later 1 s window of requests sent is at
    least 99% successful (windows start at each request); None if that never happens."""
    after = sorted((x.sent, x.ok) for x in samples if x.sent >= healthy_from)
    if not after:
        return None
    times = [t for t, _ in after]
    bad = [0]
    for _, ok in after:
        bad.append(bad[-1] + (0 if ok else 1))
    last_bad_start = -1
    j = 0
    for k in range(len(after)):
        j = max(j, k)
        while j < len(after) and times[j] < times[k] + 1.0:
            j += 1
        n = j - k
        if n and (bad[j] - bad[k]) / n > 0.01:
            last_bad_start = k
    if last_bad_start < 0:
        return 0.0
    if last_bad_start + 1 >= len(after):
        return None
    return times[last_bad_start + 1] - healthy_from


def pct(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    if not ordered:
        return math.nan
    k = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[k]


def figures(sc: Scenario, run: Run, plan: list[tuple[float, int]]) -> dict[str, float | None]:
    s = run.samples
    n = max(1, len(s))
    out: dict[str, float | None] = {}
    for m in sc.metrics:
        if m == "success":
            out[m] = 100.0 * sum(x.ok for x in s) / n
        elif m == "calls":
            out[m] = run.calls / n
        elif m == "extra":
            out[m] = 100.0 * (run.calls / n - 1.0)
        elif m == "outage-calls":
            ids = outage_ids(sc, plan)
            k = (ids[1] - ids[0]) if ids else 1
            out[m] = run.outage_calls / max(1, k)
        elif m == "recovery":
            healthy = sc.outage[1] if sc.outage else sc.phases[0][0]
            out[m] = recovery_time(s, healthy)
        elif m == "goodput":
            length, _ = sc.phases[0]
            good = sum(1 for x in s if x.ok and x.sent < length)
            assert sc.capacity is not None
            w, service = sc.capacity.split(":")
            capacity = int(w) / (float(service.rstrip("ms")) / 1000)
            out[m] = 100.0 * good / length / capacity
        elif m == "p99":
            out[m] = 1000.0 * pct([x.latency for x in s], 0.99)
        elif m == "p50":
            out[m] = 1000.0 * pct([x.latency for x in s], 0.50)
    return out


UNITS = {
    "success": ("success", "%", "{:.1f}%"),
    "calls": ("upstream calls / request", "", "{:.2f}"),
    "extra": ("extra upstream load", "%", "{:+.1f}%"),
    "outage-calls": ("calls at the bottom / request", "", "{:.2f}"),
    "recovery": ("seconds back to >99% ok", "s", "{:.1f}s"),
    "goodput": ("goodput, % of capacity", "%", "{:.0f}%"),
    "p99": ("p99 latency", "ms", "{:.0f} ms"),
    "p50": ("p50 latency", "ms", "{:.0f} ms"),
}


def cell(metric: str, v: float | None, direct: float | None) -> str:
    if v is None:
        return "never"
    text = UNITS[metric][2].format(v)
    if direct is not None and direct not in (0, None) and metric not in ("extra",):
        text += f" (x{v / direct:.2f})"
    return text


# -- the run -----------------------------------------------------------------------------------


async def run_one(
    sc: Scenario, product: str, seconds: float, rate: float, workdir: Path, verbose: bool
) -> dict[str, float | None]:
    procs = Procs(workdir)
    plan = schedule(sc, seconds, rate)
    ids = outage_ids(sc, plan)
    try:
        args = ["upstream", "--fault", sc.fault, "--seed", "13"]
        if ids is not None:
            args += ["--outage", f"{ids[0]}:{ids[1]}"]
        if sc.capacity:
            args += ["--capacity", sc.capacity]
        bottom = faultd(procs, "bottom", args)
        port = build_chain(procs, product, bottom, sc)
        await asyncio.sleep(0.3)
        await stats(bottom, reset=True)
        run = Run()
        run.samples = await load(port, plan, sc)
        await asyncio.sleep(0.2)
        st = await stats(bottom)
        run.calls = st["calls"]
        run.outage_calls = st.get("outage_calls", 0)
        if verbose:
            fates = Counter(x.fate for x in run.samples)
            print(f"    {product:<14} fates {dict(fates.most_common(6))}", flush=True)
        return figures(sc, run, plan)
    finally:
        procs.stop()


def check_tools() -> None:
    missing = [t for t in ("nginx", "haproxy") if shutil.which(t) is None]
    if missing:
        sys.exit(f"missing {', '.join(missing)} (Debian: apt-get install nginx-light haproxy)")


async def main_async(args: argparse.Namespace) -> list[dict[str, object]]:
    chosen = scenarios(args.seconds, args.rate)
    if args.only:
        keys = set(args.only.split(","))
        unknown = keys - {s.key for s in chosen}
        if unknown:
            sys.exit(f"unknown scenario(s) {', '.join(sorted(unknown))}")
        chosen = [s for s in chosen if s.key in keys]
    products = args.products.split(",")
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory(prefix="storm-") as tmp:
        for sc in chosen:
            print(f"{sc.key}: {sc.title}", flush=True)
            figs = {}
            for product in products:
                figs[product] = await run_one(
                    sc, product, args.seconds, args.rate, Path(tmp), args.verbose
                )
            rows.append({"scenario": sc.key, "title": sc.title, "figures": figs})
    print_table(rows, products)
    return rows


def print_table(rows: list[dict[str, object]], products: list[str]) -> None:
    widths = [44, 26] + [22] * len(products)
    header = ["scenario", "figure", *products]
    line = "".join(
        h.ljust(w) if i < 2 else h.rjust(w)
        for i, (h, w) in enumerate(zip(header, widths, strict=True))
    )
    print()
    print(line)
    print("-" * len(line))
    for row in rows:
        figs = row["figures"]
        assert isinstance(figs, dict)
        metrics = list(next(iter(figs.values())).keys())
        for j, m in enumerate(metrics):
            direct = figs.get("direct", {}).get(m)
            cells = [cell(m, figs[p].get(m), direct) for p in products]
            title = str(row["title"]) if j == 0 else ""
            print(
                title.ljust(widths[0])
                + UNITS[m][0].ljust(widths[1])
                + "".join(c.rjust(w) for c, w in zip(cells, widths[2:], strict=True))
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--only", help="comma-separated scenario keys")
    ap.add_argument("--products", default=",".join(PRODUCTS))
    ap.add_argument("--seconds", type=float, default=10.0, help="length of steady scenarios")
    ap.add_argument("--rate", type=float, default=100.0, help="client requests per second")
    ap.add_argument("--json", help="also write the figures here")
    ap.add_argument("-v", "--verbose", action="store_true", help="print fates per run")
    ap.add_argument(
        "--sidecar-set",
        action="append",
        default=[],
        help="a YAML line added under retry-sidecar's defaults (to measure other settings; "
        "the table is only the shipped defaults without it), e.g. 'budget: {ratio: 0.5}'",
    )
    ap.add_argument(
        "--adaptive",
        action="store_true",
        help=f"add a column '{ADAPTIVE}': retry-sidecar with a route that turns on hedging and "
        "the adaptive concurrency limit (hedge.enabled, bulkhead.adaptive; both opt-in)",
    )
    args = ap.parse_args()
    if args.adaptive and ADAPTIVE not in args.products.split(","):
        args.products += "," + ADAPTIVE
    SIDECAR_SET.extend(args.sidecar_set)
    check_tools()
    import uvloop

    rows = uvloop.run(main_async(args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

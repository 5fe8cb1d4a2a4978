"""Side-by-side performance: retry-sidecar vs nginx vs HAProxy as a reverse proxy, one run.

    python3 bench/perf.py [--duration 10] [--quick] [--json bench/results/perf.json]
                          [--before CHECKOUT] [--rounds N] [--grpc] [--h2]

Installs what it needs (nginx-light, haproxy, wrk from Debian's packages) if missing, starts an
upstream nginx (~100-byte replies, keep-alive), nginx as proxy, HAProxy as proxy, retry-sidecar
(shipped defaults, pure and mypyc-compiled builds side by side; tracing off) and the two floor
proxies of bench/floor.py (``floor-aiohttp``: aiohttp's low-level server plus the sidecar's
upstream client, nothing else; ``floor-protocol``: the same client behind a plain
asyncio.Protocol with httptools; both run the compiled build's upstream client), pins every
proxy to CPU 0 and the upstream and wrk to CPU 1, and measures, alternating A B A B:

- peak throughput (wrk, 16 and 64 connections);
- added latency at a fixed rate (500 and 2,000 req/s; p50/p99/p99.9 minus direct);
- CPU microseconds per request at the fixed rates;
- RSS after load;
- 1 MiB bodies streamed both ways (MB/s);
- 10,000 idle keep-alive client connections (RSS per connection);
- TLS to the upstream (docs/tls.md): the same upstream nginx also serves HTTPS (a trustme CA
  and leaf made for the run); ``nginx-tls`` proxies to it with ``proxy_ssl_verify on`` and
  keep-alive, ``sidecar-tls`` (the compiled build) through an ``https://`` route verified
  against that CA. Their peak and CPU per request are in the same rotation, and compared with
  nginx-tls and with the sidecar's own plaintext figures (aim: <= 1.3x);
- the TLS listener: ``nginx-tls-listener`` and ``sidecar-tls-listener`` (the compiled build
  with ``server_tls``) terminate TLS in front of the plaintext upstream, with wrk over https
  and keep-alive; compared with the sidecar's plaintext row and with nginx (aim: <= 1.3x).

The floors relay GET only, so they skip the 1 MiB bodies ("-" in the table). It prints a
table, the ratios retry-sidecar / nginx, and what share of the sidecar's CPU per request the
floors account for (floor-aiohttp / sidecar: the part no change inside the sidecar can remove
while it keeps aiohttp's server; floor-aiohttp minus floor-protocol: what aiohttp's
per-request server machinery costs), and writes JSON. ``--before CHECKOUT`` adds that checkout's
two builds (``before-sidecar-pure``, ``before-sidecar-compiled``) to the same rotation:
figures before and after a change, in the same run. Loopback only; bounded in time; it stops
every process it started, by PID. ``--grpc`` and ``--h2`` add the HTTP/2 and gRPC rows of
bench/h2rows.py (gRPC unary direct / nginx grpc_pass / sidecar; HTTP/2 GETs through nginx and the
sidecar's h2c listener), one round of them after each round of the rows above; without them the
run measures what it always did.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PURE = "sidecar-pure"
COMPILED = "sidecar-compiled"
FLOOR_AIOHTTP = "floor-aiohttp"
FLOOR_PROTOCOL = "floor-protocol"
FLOORS = (FLOOR_AIOHTTP, FLOOR_PROTOCOL)
NGINX_TLS = "nginx-tls"
SIDECAR_TLS = "sidecar-tls"
# The TLS listener: nginx terminating TLS to the same plaintext upstream, and the compiled
# sidecar with server_tls; wrk speaks https and keeps its connections (handshakes amortised).
NGINX_TLS_IN = "nginx-tls-listener"
SIDECAR_TLS_IN = "sidecar-tls-listener"
TLS_ARMS = (NGINX_TLS, SIDECAR_TLS, NGINX_TLS_IN, SIDECAR_TLS_IN)
RATES = (500, 1000, 2000)
PROXY_CPU = 0
LOAD_CPU = 1
SMALL_BODY = "x" * 100
BIG = 1024 * 1024
CLK_TCK = os.sysconf("SC_CLK_TCK")
NOFILE = 20000  # set from the real limit in main()
PAGE = os.sysconf("SC_PAGE_SIZE")
LOG_LEVEL = "warning"  # the sidecars' --log-level (info: the shipped one, access log written)


def ensure_tools() -> None:
    missing = [t for t in ("nginx", "haproxy", "wrk") if shutil.which(t) is None]
    if not missing:
        return
    pkgs = {"nginx": "nginx-light", "haproxy": "haproxy", "wrk": "wrk"}
    print(f"installing {', '.join(missing)} from Debian's packages...", flush=True)
    subprocess.run(["apt-get", "update", "-qq"], check=True)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", *(pkgs[m] for m in missing)],
        check=True,
        env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pin(cpu: int) -> Any:
    def fn() -> None:
        os.sched_setaffinity(0, {cpu})
        raise_nofile()

    return fn


def raise_nofile() -> int:
    """As many descriptors as the hard limit allows (10,000 idle connections need them)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


@dataclass
class Proc:
    name: str
    port: int
    popen: subprocess.Popen[bytes] | None = None

    def pids(self) -> list[int]:
        """The process and all its descendants (nginx master + worker)."""
        assert self.popen is not None
        root = self.popen.pid
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                children.setdefault(int(parts[1]), []).append(int(entry))
            except (OSError, IndexError):
                continue
        out, todo = [], [root]
        while todo:
            p = todo.pop()
            out.append(p)
            todo.extend(children.get(p, []))
        return out

    def cpu_seconds(self) -> float:
        total = 0
        for p in self.pids():
            try:
                with open(f"/proc/{p}/stat") as f:
                    parts = f.read().rsplit(")", 1)[1].split()
                total += int(parts[11]) + int(parts[12])
            except OSError:
                pass
        return total / CLK_TCK

    def rss_mb(self) -> float:
        total = 0
        for p in self.pids():
            try:
                with open(f"/proc/{p}/statm") as f:
                    total += int(f.read().split()[1]) * PAGE
            except OSError:
                pass
        return total / 1e6

    def stop(self) -> None:
        if self.popen is not None and self.popen.poll() is None:  # only what we started, by PID
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def wait_port(port: int, timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def start_into(
    proc: Proc, cmd: list[str], cpu: int, log: Path, cwd: Path | None = None, path: str = ""
) -> None:
    """Start ``cmd`` pinned to ``cpu``; ``cwd`` (a built tree) goes first on PYTHONPATH, then
    ``path``."""
    out = open(log, "wb")  # noqa: SIM115 - kept open for the process's life
    env = None
    if cwd is not None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(cwd), path)))}
    proc.popen = subprocess.Popen(
        cmd, stdout=out, stderr=out, preexec_fn=pin(cpu), cwd=cwd, env=env
    )
    wait_port(proc.port)


NGINX_COMMON = """
worker_processes 1;
worker_rlimit_nofile {nofile};
daemon off;
pid {d}/{n}.pid;
events {{ worker_connections {conns}; multi_accept on; }}
http {{
  access_log off;
  client_body_temp_path {d}/{n}-cbt;
  proxy_temp_path {d}/{n}-pt;
  fastcgi_temp_path {d}/{n}-ft;
  uwsgi_temp_path {d}/{n}-ut;
  scgi_temp_path {d}/{n}-st;
  keepalive_requests 10000000;
  keepalive_timeout 300s;
  client_max_body_size 16m;
  {body}
}}
"""


def make_certs(d: Path) -> tuple[str, str, str]:
    """A CA and a leaf for localhost / 127.0.0.1, made for this run: (ca, cert, key) files."""
    import trustme

    ca = trustme.CA()
    leaf = ca.issue_cert("localhost", "127.0.0.1")
    paths = (d / "ca.pem", d / "leaf.pem", d / "leaf.key")
    ca.cert_pem.write_to_path(str(paths[0]))
    paths[1].write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    paths[2].write_bytes(leaf.private_key_pem.bytes())
    return str(paths[0]), str(paths[1]), str(paths[2])


def nginx_upstream(d: Path, port: int, tls_port: int, cert: str, key: str) -> list[str]:
    """The upstream, plaintext on ``port`` and HTTPS on ``tls_port`` (same answers)."""
    (d / "www").mkdir(exist_ok=True)
    (d / "www" / "big").write_bytes(b"b" * BIG)
    locations = f"""
    client_body_buffer_size 2m;
    location = /big {{ root {d}/www; error_page 405 =200 $uri; }}
    location / {{ default_type text/plain; return 200 "{SMALL_BODY}"; }}"""
    body = f"""
  server {{
    listen 127.0.0.1:{port} backlog=4096;{locations}
  }}
  server {{
    listen 127.0.0.1:{tls_port} ssl backlog=4096;
    ssl_certificate {cert}; ssl_certificate_key {key};
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache shared:up:10m;{locations}
  }}"""
    return nginx_command(d, "upstream", body)


def nginx_tls_proxy(d: Path, port: int, up: int, ca: str) -> list[str]:
    """nginx proxying to the HTTPS upstream, verified (proxy_ssl_verify on), keep-alive."""
    body = f"""
  upstream tls_up {{ server 127.0.0.1:{up}; keepalive 256; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass https://tls_up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_ssl_verify on;
      proxy_ssl_trusted_certificate {ca};
      proxy_ssl_name localhost;
      proxy_ssl_server_name on;
      proxy_ssl_session_reuse on;
    }}
  }}"""
    return nginx_command(d, "proxy-tls", body)


def nginx_command(d: Path, name: str, body: str) -> list[str]:
    """Write d/<name>.conf around ``body`` and return the command that runs it."""
    conf = d / f"{name}.conf"
    conf.write_text(NGINX_COMMON.format(d=d, n=name, body=body, nofile=NOFILE, conns=NOFILE // 2))
    return ["nginx", "-p", str(d), "-c", str(conf), "-e", str(d / f"{name}.err")]


def nginx_proxy(d: Path, port: int, up: int, tls: tuple[str, str] | None = None) -> list[str]:
    listen = f"listen 127.0.0.1:{port} backlog=4096;"
    if tls is not None:  # TLS terminated here, as the sidecar's TLS listener does
        listen = (
            f"listen 127.0.0.1:{port} ssl backlog=4096;\n    ssl_certificate {tls[0]};\n"
            f"    ssl_certificate_key {tls[1]};\n    ssl_protocols TLSv1.2 TLSv1.3;"
        )
    body = f"""
  upstream up {{ server 127.0.0.1:{up}; keepalive 256; }}
  server {{
    {listen}
    location / {{
      proxy_pass http://up;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }}
  }}"""
    return nginx_command(d, "proxy-tls-listener" if tls else "proxy", body)


def haproxy(d: Path, port: int, up: int) -> list[str]:
    conf = d / "haproxy.cfg"
    conf.write_text(f"""
global
  nbthread 1
  maxconn {NOFILE // 2 - 200}
defaults
  mode http
  timeout connect 5s
  timeout client 300s
  timeout server 300s
  option http-keep-alive
frontend fe
  bind 127.0.0.1:{port}
  default_backend be
backend be
  http-reuse always
  server s1 127.0.0.1:{up} maxconn 1000
""")
    return ["haproxy", "-f", str(conf), "-db"]


def sidecar(
    d: Path,
    port: int,
    admin: int,
    up: int,
    name: str,
    ca: str | None = None,
    *,
    listener: tuple[str, str] | None = None,
) -> list[str]:
    """retry-sidecar with the shipped defaults (one route to the upstream); ``ca``: to the
    HTTPS upstream on ``up``, verified against it; ``listener``: its own listener over TLS with
    that certificate and key."""
    conf = d / f"{name}.yaml"
    server_tls = (
        f"server_tls: {{cert_file: {listener[0]}, key_file: {listener[1]}}}" if listener else ""
    )
    upstream = f"http://127.0.0.1:{up}" if ca is None else f"https://localhost:{up}"
    tls = "" if ca is None else f"    tls: {{ca_file: {ca}}}\n"
    conf.write_text(f"""
version: 1
name: bench
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
{server_tls}
routes:
  - name: bench
    upstream: "{upstream}"
{tls}""")
    return [sys.executable, "-m", "sidecar", "run", "--config", str(conf), "--log-level", LOG_LEVEL]


def url(port: int, path: str = "/") -> str:
    return f"{'https' if port in TLS_PORTS else 'http'}://127.0.0.1:{port}{path}"


TLS_PORTS: set[int] = set()  # the ports of the TLS listener arms (wrk speaks https to them)


def floor(kind: str, port: int, up: int) -> list[str]:
    """A floor proxy of bench/floor.py (``bench`` is imported from this checkout)."""
    return [sys.executable, "-m", "bench.floor", kind, "--listen", str(port), "--upstream", str(up)]


def build_tree(d: Path, compiled: bool, root: Path | None = None, prefix: str = "") -> Path:
    """A copy of the package to run (of ``root``, this checkout by default): pure, or with the
    hot path compiled in place (setup.py)."""
    root = root or Path(__file__).resolve().parent.parent
    tree = d / (prefix + ("compiled" if compiled else "pure"))
    tree.mkdir()
    shutil.copytree(
        root / "sidecar", tree / "sidecar", ignore=shutil.ignore_patterns("*.so", "__pycache__")
    )
    for f in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(root / f, tree / f)
    if compiled:
        print("compiling the hot path with mypyc...", flush=True)
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            env={**os.environ, "RETRY_SIDECAR_BUILD": "compiled"},
            check=True,
            capture_output=True,
        )
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "--version"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()
    print(f"  {tree.name}: {out}", flush=True)
    return tree


# -- load generation -------------------------------------------------------------------------

FIXED_RATE_LUA = """
local rate = tonumber(os.getenv("RATE"))
local conns = tonumber(os.getenv("CONNS"))
function delay() return conns * 1000 / rate end
done = function(summary, latency, requests)
  io.write(string.format("REQS %d\\n", summary.requests))
  io.write(string.format("ERRS %d\\n", summary.errors.status + summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout))
  for _, p in pairs({50, 99, 99.9}) do
    io.write(string.format("P%s %d\\n", p, latency:percentile(p)))
  end
end
"""

BIG_LUA = """
wrk.method = "POST"
wrk.body = string.rep("a", BIGSIZE)
wrk.headers["Content-Type"] = "application/octet-stream"
done = function(summary, latency, requests)
  io.write(string.format("REQS %d\\n", summary.requests))
  io.write(string.format("BYTES %d\\n", summary.bytes))
end
""".replace("BIGSIZE", str(BIG))


def wrk(args: list[str], env: dict[str, str] | None = None) -> str:
    res = subprocess.run(
        ["taskset", "-c", str(LOAD_CPU), "wrk", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=600,
    )
    if res.returncode != 0:
        raise RuntimeError(res.stderr)
    return res.stdout


def peak(port: int, conns: int, duration: float) -> float:
    out = wrk(["-t1", f"-c{conns}", f"-d{int(duration)}s", url(port)])
    m = re.search(r"Requests/sec:\s+([\d.]+)", out)
    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if errs:
        print(f"  warning: {errs.group(1)} non-2xx responses on port {port}", flush=True)
    return float(m.group(1)) if m else 0.0


def fixed_rate(port: int, rate: int, duration: float, script: Path) -> dict[str, float]:
    conns = max(4, rate // 100)
    out = wrk(
        [
            "-t1",
            f"-c{conns}",
            f"-d{int(duration)}s",
            "-s",
            str(script),
            url(port),
        ],
        env={"RATE": str(rate), "CONNS": str(conns)},
    )
    vals = dict(re.findall(r"^(REQS|ERRS|P50|P99|P99\.9) (\d+)$", out, re.M))
    return {
        "requests": float(vals.get("REQS", 0)),
        "errors": float(vals.get("ERRS", 0)),
        "p50_ms": float(vals.get("P50", 0)) / 1000,
        "p99_ms": float(vals.get("P99", 0)) / 1000,
        "p999_ms": float(vals.get("P99.9", 0)) / 1000,
    }


def big_bodies(port: int, duration: float, script: Path) -> float:
    out = wrk(["-t1", "-c8", f"-d{int(duration)}s", "-s", str(script), url(port, "/big")])
    reqs = float(re.search(r"^REQS (\d+)$", out, re.M).group(1))  # type: ignore[union-attr]
    return reqs * 2 * BIG / duration / 1e6  # MB/s, request and response bodies together


async def idle_connections(port: int, n: int) -> list[socket.socket]:
    """Open n keep-alive connections, each having done one request, and keep them open."""
    socks: list[socket.socket] = []
    req = b"GET / HTTP/1.1\r\nHost: bench\r\n\r\n"

    async def one() -> None:
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(req)
        await w.drain()
        head = await r.readuntil(b"\r\n\r\n")
        m = re.search(rb"(?i)content-length: (\d+)", head)
        if m:
            await r.readexactly(int(m.group(1)))
        sock = w.get_extra_info("socket")
        socks.append(sock.dup())
        w.close()

    for i in range(0, n, 200):
        await asyncio.gather(*(one() for _ in range(min(200, n - i))))
    return socks


@dataclass
class Results:
    rows: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, name: str, key: str, value: float) -> None:
        self.rows.setdefault(name, {}).setdefault(key, []).append(value)

    def mean(self, name: str, key: str) -> float:
        v = self.rows.get(name, {}).get(key, [])
        return sum(v) / len(v) if v else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per wrk run")
    ap.add_argument("--quick", action="store_true", help="3 s runs, one alternation")
    ap.add_argument("--idle", type=int, default=10000, help="idle keep-alive connections")
    ap.add_argument("--json", default="bench/results/perf.json")
    ap.add_argument(
        "--before", default=None, help="another checkout, run beside this one (same run)"
    )
    ap.add_argument(
        "--log-level", default="warning", help="the sidecars' (info writes the access log)"
    )
    ap.add_argument(
        "--arms",
        default="",
        help="only these proxies (comma-separated names, e.g. nginx,sidecar-compiled,"
        "nginx-tls-listener,sidecar-tls-listener); direct is always measured",
    )
    ap.add_argument("--rounds", type=int, default=None, help="alternations (default 2; --quick 1)")
    ap.add_argument("--grpc", action="store_true", help="gRPC rows too (bench/h2rows.py)")
    ap.add_argument("--h2", action="store_true", help="HTTP/2 (h2load) rows too (bench/h2rows.py)")
    args = ap.parse_args()
    global LOG_LEVEL
    LOG_LEVEL = args.log_level
    if args.quick:
        args.duration = 3.0
    rounds = args.rounds or (1 if args.quick else 2)
    ensure_tools()
    global NOFILE
    limit = NOFILE = raise_nofile()
    if args.idle * 2 + 1000 > limit:
        args.idle = max(100, (limit - 1000) // 2)
        print(f"descriptor limit {limit}: idle connections reduced to {args.idle}", flush=True)
    d = Path(tempfile.mkdtemp(prefix="retry-sidecar-bench-"))
    (d / "fixed.lua").write_text(FIXED_RATE_LUA)
    (d / "big.lua").write_text(BIG_LUA)
    up_port, up_tls = free_port(), free_port()
    ca, cert, key = make_certs(d)
    procs: list[Proc] = []
    res = Results()
    try:
        upstream = Proc("upstream", up_port)
        procs.append(upstream)
        start_into(upstream, nginx_upstream(d, up_port, up_tls, cert, key), LOAD_CPU, d / "up.log")
        wait_port(up_tls)
        p_ng, p_ha = free_port(), free_port()
        p_sp, p_sc, a_sp, a_sc = free_port(), free_port(), free_port(), free_port()
        p_fa, p_fp = free_port(), free_port()
        p_nt, p_st, a_st = free_port(), free_port(), free_port()
        p_ni, p_si, a_si = free_port(), free_port(), free_port()
        TLS_PORTS.update((p_ni, p_si))
        arms = set(args.arms.split(",")) if args.arms else None
        pure = build_tree(d, False) if arms is None or PURE in arms else d
        compiled = build_tree(d, True)
        here = str(Path(__file__).resolve().parent.parent)
        proxies: list[Proc] = []
        for name, cmd, port, cwd in (
            ("nginx", nginx_proxy(d, p_ng, up_port), p_ng, None),
            ("haproxy", haproxy(d, p_ha, up_port), p_ha, None),
            (PURE, sidecar(d, p_sp, a_sp, up_port, PURE), p_sp, pure),
            (COMPILED, sidecar(d, p_sc, a_sc, up_port, COMPILED), p_sc, compiled),
            # The floors' upstream client is the compiled one: the lowest the floor can be.
            (FLOOR_AIOHTTP, floor("aiohttp", p_fa, up_port), p_fa, compiled),
            (FLOOR_PROTOCOL, floor("protocol", p_fp, up_port), p_fp, compiled),
            *before_arms(d, args.before, up_port),
            (NGINX_TLS, nginx_tls_proxy(d, p_nt, up_tls, ca), p_nt, None),
            (SIDECAR_TLS, sidecar(d, p_st, a_st, up_tls, SIDECAR_TLS, ca), p_st, compiled),
            (NGINX_TLS_IN, nginx_proxy(d, p_ni, up_port, (cert, key)), p_ni, None),
            (
                SIDECAR_TLS_IN,
                sidecar(d, p_si, a_si, up_port, SIDECAR_TLS_IN, listener=(cert, key)),
                p_si,
                compiled,
            ),
        ):
            if arms is not None and name not in arms:
                continue
            # Kept in procs as soon as it exists, so a later failure still stops it.
            px = Proc(name, port)
            procs.append(px)
            start_into(px, cmd, PROXY_CPU, d / f"{name}.log", cwd, here)
            proxies.append(px)
        h2arms = None
        if args.grpc or args.h2:
            if str(Path(__file__).resolve().parent.parent) not in sys.path:
                sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
            from bench import h2rows

            h2arms = h2rows.start(d, procs, grpc=args.grpc, h2=args.h2, up=up_port, tree=compiled)
        targets: list[tuple[str, int, Proc | None]] = [("direct", up_port, None)]
        targets += [(p.name, p.port, p) for p in proxies]
        for _name, port, _ in targets:  # warm up
            peak(port, 16, 1.0)
        for r in range(rounds):
            print(f"round {r + 1}/{rounds}: peak throughput", flush=True)
            for conns in (16, 64):
                for name, port, _ in targets:
                    res.add(name, f"peak_c{conns}", peak(port, conns, args.duration))
            print(f"round {r + 1}/{rounds}: fixed rates", flush=True)
            for rate in RATES:
                for name, port, proc in targets:
                    cpu0 = proc.cpu_seconds() if proc else 0.0
                    fr = fixed_rate(port, rate, args.duration, d / "fixed.lua")
                    cpu1 = proc.cpu_seconds() if proc else 0.0
                    for k, v in fr.items():
                        res.add(name, f"r{rate}_{k}", v)
                    if proc and fr["requests"]:
                        res.add(name, f"r{rate}_cpu_us", (cpu1 - cpu0) * 1e6 / fr["requests"])
            if h2arms is not None:
                print(f"round {r + 1}/{rounds}: HTTP/2 and gRPC rows", flush=True)
                h2rows.measure_round(res, h2arms, args.duration)
            for name, _, proc in targets:
                if proc:
                    res.add(name, "rss_mb", proc.rss_mb())
            print(f"round {r + 1}/{rounds}: 1 MiB bodies", flush=True)
            for name, port, proc in targets:
                if name in FLOORS or name in TLS_ARMS:
                    continue  # GET only; the TLS arms: peak and CPU per request only
                res.add(name, "big_mb_s", big_bodies(port, args.duration, d / "big.lua"))
                if proc:
                    res.add(name, "rss_after_big_mb", proc.rss_mb())
        print(f"idle connections: {args.idle} per proxy", flush=True)
        for p in proxies:
            if p.name in TLS_ARMS:
                continue  # the client side is plaintext: the same as their plaintext arms
            before = p.rss_mb()
            socks = asyncio.run(idle_connections(p.port, args.idle))
            time.sleep(1.0)
            after = p.rss_mb()
            res.add(p.name, "idle_added_mb", after - before)
            res.add(p.name, "idle_kb_per_conn", (after - before) * 1000 / max(1, len(socks)))
            for s in socks:
                s.close()
    finally:
        for p in reversed(procs):
            p.stop()
        shutil.rmtree(d, ignore_errors=True)
    report(res)
    if h2arms is not None:
        h2rows.report(res, h2arms)
    out = {name: {k: sum(v) / len(v) for k, v in row.items()} for name, row in res.rows.items()}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.json}")
    return 0


def before_arms(d: Path, before: str | None, up: int) -> list[tuple[str, list[str], int, Path]]:
    """The two builds of another checkout (``--before``), as more proxies of the rotation."""
    if before is None:
        return []
    arms = []
    for name, compiled in ((PURE, False), (COMPILED, True)):
        port, admin = free_port(), free_port()
        tree = build_tree(d, compiled, Path(before).resolve(), "before-")
        arms.append(("before-" + name, sidecar(d, port, admin, up, "before-" + name), port, tree))
    return arms


def report(res: Results) -> None:
    before = [n for n in (f"before-{PURE}", f"before-{COMPILED}") if n in res.rows]
    names = ["direct", "nginx", "haproxy", PURE, COMPILED, *FLOORS, *before, *TLS_ARMS]
    names = [n for n in names if n in res.rows]  # --arms measures some of them
    m = res.mean

    def added(name: str, key: str) -> float:
        return m(name, key) - m("direct", key)

    w = 17
    print(f"\n{'':<34}" + "".join(f"{n:>{w}}" for n in names))
    for label, key in (("peak req/s, 16 conns", "peak_c16"), ("peak req/s, 64 conns", "peak_c64")):
        print(f"{label:<34}" + "".join(f"{m(n, key):>{w}.0f}" for n in names))
    for rate in RATES:
        for pk in ("p50_ms", "p99_ms", "p999_ms"):
            label = f"added {pk[:-3]} ms at {rate}/s"
            cells = ["-"] + [f"{added(n, f'r{rate}_{pk}'):.3f}" for n in names[1:]]
            print(f"{label:<34}" + "".join(f"{c:>{w}}" for c in cells))
        cells = ["-"] + [f"{m(n, f'r{rate}_cpu_us'):.1f}" for n in names[1:]]
        print(f"{f'CPU us/request at {rate}/s':<34}" + "".join(f"{c:>{w}}" for c in cells))
    for label, key in (
        ("RSS MB after load", "rss_mb"),
        ("RSS MB after 1 MiB bodies", "rss_after_big_mb"),
        ("1 MiB bodies, MB/s both ways", "big_mb_s"),
        ("idle conns: MB added", "idle_added_mb"),
        ("idle conns: KB per conn", "idle_kb_per_conn"),
    ):
        cells = [f"{m(n, key):.1f}" if key in res.rows.get(n, {}) else "-" for n in names]
        print(f"{label:<34}" + "".join(f"{c:>{w}}" for c in cells))

    listener_report(res, w)
    ng = "nginx"
    if not {PURE, COMPILED, ng, SIDECAR_TLS, NGINX_TLS, *FLOORS} <= set(res.rows):
        return  # --arms: the rows below need every arm
    print("\nratios to nginx in this run (targets in brackets):")
    print(f"{'':<34}{PURE:>{w}}{COMPILED:>{w}}")

    def row(label: str, fn: Any, target: str) -> None:
        print(f"{label:<34}" + "".join(f"{fn(n):>{w}}" for n in (PURE, COMPILED)) + f"   {target}")

    row("peak, 64 conns", lambda n: f"{m(n, 'peak_c64') / m(ng, 'peak_c64'):.3f}x", "(>= 0.35x)")
    row("peak, 16 conns", lambda n: f"{m(n, 'peak_c16') / m(ng, 'peak_c16'):.3f}x", "(>= 0.35x)")
    for rate in (1000, 2000):
        row(
            f"CPU per request at {rate}/s",
            lambda n, r=rate: f"{m(n, f'r{r}_cpu_us') / m(ng, f'r{r}_cpu_us'):.2f}x",
            "(<= 3x)",
        )
        row(
            f"  absolute at {rate}/s",
            lambda n, r=rate: f"{m(n, f'r{r}_cpu_us'):.0f} us",
            "(<= 80 us)",
        )
    row(
        "added p99 at 500/s",
        lambda n: f"{added(n, 'r500_p99_ms') / max(1e-6, added(ng, 'r500_p99_ms')):.2f}x",
        "(<= 2x)",
    )
    row("1 MiB bodies MB/s", lambda n: f"{m(n, 'big_mb_s') / m(ng, 'big_mb_s'):.2f}x", "")
    row("RSS under load", lambda n: f"{m(n, 'rss_mb'):.1f} MB", "(no regression: 47 MB)")
    row("per idle connection", lambda n: f"{m(n, 'idle_kb_per_conn'):.1f} KB", "(10 KB)")

    print("\nTLS to the upstream, keep-alive (sidecar-tls: the compiled build, verified):")
    for label, fn in (
        (
            "peak 64 conns / nginx-tls",
            lambda: m(SIDECAR_TLS, "peak_c64") / m(NGINX_TLS, "peak_c64"),
        ),
        (
            "peak 64 conns / own plaintext",
            lambda: m(SIDECAR_TLS, "peak_c64") / m(COMPILED, "peak_c64"),
        ),
        ("nginx-tls peak / nginx plaintext", lambda: m(NGINX_TLS, "peak_c64") / m(ng, "peak_c64")),
    ):
        print(f"{label:<40}{fn():>{w}.2f}x")
    for rate in (1000, 2000):
        k = f"r{rate}_cpu_us"
        print(
            f"{f'CPU/request at {rate}/s':<40}"
            f"{m(SIDECAR_TLS, k) / m(NGINX_TLS, k):>{w}.2f}x vs nginx-tls"
            f"{m(SIDECAR_TLS, k) / m(COMPILED, k):>{w}.2f}x vs own plaintext (<= 1.3x)"
            f"   ({m(SIDECAR_TLS, k):.0f} us; nginx-tls {m(NGINX_TLS, k):.0f} us, "
            f"nginx {m(ng, k):.0f} us)"
        )

    print("\nthe floors' share of the sidecar's CPU per request (bench/floor.py):")
    print(f"{'':<34}{PURE:>{w}}{COMPILED:>{w}}")
    for rate in (1000, 2000):
        for fl in FLOORS:
            row(
                f"{fl} / sidecar at {rate}/s",
                lambda n, r=rate, f=fl: f"{m(f, f'r{r}_cpu_us') / m(n, f'r{r}_cpu_us'):.2f}x",
                f"({fl}: {m(fl, f'r{rate}_cpu_us'):.0f} us)",
            )
        row(
            f"aiohttp server share at {rate}/s",
            lambda n, r=rate: (
                f"{(m(FLOOR_AIOHTTP, f'r{r}_cpu_us') - m(FLOOR_PROTOCOL, f'r{r}_cpu_us')) / m(n, f'r{r}_cpu_us'):.2f}x"
            ),
            "((floor-aiohttp - floor-protocol) / sidecar)",
        )


def listener_report(res: Results, w: int) -> None:
    """The TLS listener beside the plaintext one: sidecar-tls-listener / sidecar-compiled (aim:
    CPU per request <= 1.3x) and / nginx-tls-listener, same run."""
    if not {SIDECAR_TLS_IN, NGINX_TLS_IN, COMPILED} <= set(res.rows):
        return
    m = res.mean
    print("\nthe TLS listener (keep-alive, wrk over https):")
    print(f"{'':<34}{'/ sidecar plain':>{w}}{'/ nginx-tls-listener':>{w + 4}}")
    for label, key in (("peak, 64 conns", "peak_c64"), ("peak, 16 conns", "peak_c16")):
        cells = [f"{m(SIDECAR_TLS_IN, key) / m(o, key):.3f}x" for o in (COMPILED, NGINX_TLS_IN)]
        print(f"{label:<34}{cells[0]:>{w}}{cells[1]:>{w + 4}}")
    for rate in (1000, 2000):
        key = f"r{rate}_cpu_us"
        cells = [f"{m(SIDECAR_TLS_IN, key) / m(o, key):.2f}x" for o in (COMPILED, NGINX_TLS_IN)]
        print(
            f"{f'CPU per request at {rate}/s':<34}{cells[0]:>{w}}{cells[1]:>{w + 4}}"
            f"   (<= 1.3x plain; {m(SIDECAR_TLS_IN, key):.0f} us vs {m(COMPILED, key):.0f} us)"
        )


if __name__ == "__main__":
    raise SystemExit(main())

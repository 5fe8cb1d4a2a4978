"""The differential transparency harness: real upstream applications, real client libraries,
each request sent direct and through the real sidecar process, the two answers compared.

What is compared: status, interim (1xx) statuses, the response header bytes in order (minus
the documented differences below), the body's sha256 and the framing (Content-Length,
chunked, close-delimited, none). Echo endpoints of httpbin return the request they got as JSON:
there the request is compared instead, minus the documented request additions.

Documented differences (docs/headers.md, "Deliberate differences"), and only these, are removed:
- response: ``x-retry-attempts`` and ``x-retry-fate`` added (``x-retry-hedges`` too when the
  request was hedged); hop-by-hop fields
  (``Connection``, ``Keep-Alive``, ``Transfer-Encoding``, ``Trailer``) belong to each hop and
  are compared as framing instead; the ``Date`` value (each response is made at its own time);
- request (echoed): ``X-Forwarded-For/-Proto/-Host``, ``x-retry-attempt``, ``x-retry-edge``,
  ``x-request-timeout-ms``, the ``tracestate`` member, hop-by-hop fields, and a small chunked
  body forwarded with Content-Length (it is buffered so it can be resent, as nginx does);
- the listener's own host:port wherever the application echoes the Host it was sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.proc import free_port as proc_free_port

ALL_CLIENTS = ("curl", "requests", "httpx", "urllib3", "aiohttp")

# x-retry-hedges: a request the sidecar hedged (on a loaded test host an echo can outlive the
# adaptive per-try timeout of the route).
RESPONSE_ADDITIONS = {b"x-retry-attempts", b"x-retry-fate", b"x-retry-hedges"}
HOP = {b"connection", b"keep-alive", b"transfer-encoding", b"trailer", b"proxy-connection"}
REQUEST_ADDITIONS = {
    "x-forwarded-for",
    "x-forwarded-proto",
    "x-forwarded-host",
    "x-retry-attempt",
    "x-retry-edge",
    "x-request-timeout-ms",
    "tracestate",
    "connection",
    "keep-alive",
    "te",
    "expect",
}


@dataclass(frozen=True)
class Case:
    name: str
    method: str
    target: str  # origin-form, exactly as sent
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes | None = None
    chunked: bool = False  # send the body with Transfer-Encoding: chunked
    echo: bool = False  # httpbin echoes the request as JSON (or JSON lines)
    upstream: str = "bin"  # "bin" (httpbin under gunicorn) or "ngx" (nginx)
    clients: tuple[str, ...] = ALL_CLIENTS
    status: int = 200  # what the direct answer must be, so a case tests what it says


@dataclass
class Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    interim: list[int] = field(default_factory=list)

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k.lower() == name.lower():
                return v
        return None


def framing(reply: Reply, method: str) -> str:
    names = {k.lower() for k, _ in reply.headers}
    if method == "HEAD" or reply.status in (204, 304):
        return "none"
    te = reply.header(b"transfer-encoding")
    if te is not None and b"chunked" in te.lower():
        return "chunked"
    if b"content-length" in names:
        return "length"
    return "close"


def comparable(reply: Reply, case: Case, hostport: str) -> dict[str, Any]:
    """What must be equal direct and through the sidecar."""
    here = hostport.encode()
    headers = []
    for k, v in reply.headers:
        lk = k.lower()
        if lk in HOP or lk in RESPONSE_ADDITIONS:
            continue
        if lk == b"date":
            v = b"<date>"
        elif lk == b"content-length" and case.echo:
            v = b"<echo length>"
        headers.append((k, v.replace(here, b"HOST")))
    ctype = reply.header(b"content-type") or b""
    raw_body = reply.body
    if ctype.startswith(b"multipart/byteranges; boundary="):
        # nginx numbers its byterange boundaries per response: compare without them.
        boundary = ctype.split(b"=", 1)[1]
        raw_body = raw_body.replace(boundary, b"BOUNDARY")
        headers = [
            (k, v.replace(boundary, b"BOUNDARY") if k.lower() == b"content-type" else v)
            for k, v in headers
        ]
    body: Any
    if case.echo:
        body = normalize_echo(decoded(reply), hostport)
    else:
        body = hashlib.sha256(raw_body).hexdigest()
    return {
        "status": reply.status,
        "interim": reply.interim,
        "headers": headers,
        "framing": framing(reply, case.method),
        "body": body,
    }


def decoded(reply: Reply) -> bytes:
    """An echo body without its content coding (compared after normalising)."""
    coding = (reply.header(b"content-encoding") or b"").lower()
    if coding == b"gzip":
        return gzip.decompress(reply.body)
    if coding == b"deflate":
        return zlib.decompress(reply.body)
    if coding == b"br":
        import brotlicffi

        return bytes(brotlicffi.decompress(reply.body))
    return reply.body


def normalize_echo(body: bytes, hostport: str) -> Any:
    text = body.decode("utf-8", "replace").replace(hostport, "HOST")
    try:
        return _strip(json.loads(text))
    except ValueError:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        try:
            return [_strip(json.loads(ln)) for ln in lines]
        except ValueError:
            return text


def _strip(doc: Any) -> Any:
    if not isinstance(doc, dict):
        return doc
    doc = dict(doc)
    doc.pop("origin", None)
    hdrs = doc.get("headers")
    if isinstance(hdrs, dict):
        kept = {k: v for k, v in hdrs.items() if k.lower() not in REQUEST_ADDITIONS}
        if "Transfer-Encoding" in hdrs or "Content-Length" in hdrs:
            # A small chunked body goes upstream with a Content-Length (buffered to be
            # resendable): the body must be equal, its framing may differ.
            kept.pop("Transfer-Encoding", None)
            kept.pop("Content-Length", None)
        doc["headers"] = kept
    return doc


# -- clients -------------------------------------------------------------------------------


def _chunks(body: bytes) -> Iterator[bytes]:
    for i in range(0, len(body), 16384):
        yield body[i : i + 16384]


def send(client: str, base: str, case: Case, tmp: Path) -> Reply:
    return _CLIENTS[client](base, case, tmp)


def _via_curl(base: str, case: Case, tmp: Path) -> Reply:
    head_file = tmp / "curl-head"
    body_file = tmp / "curl-body"
    args = ["curl", "-sS", "--path-as-is", "-D", str(head_file), "-o", str(body_file)]
    args += ["--max-time", "30", "-H", "Accept:", "-H", "User-Agent: diff-curl"]
    if case.method == "HEAD":
        args.append("-I")
    else:
        args += ["-X", case.method]
    for k, v in case.headers:
        args += ["-H", f"{k}: {v}"]
    if case.body is not None:
        data = tmp / "curl-data"
        data.write_bytes(case.body)
        args += ["--data-binary", f"@{data}"]
        if case.chunked:
            args += ["-H", "Transfer-Encoding: chunked"]
        if not any(k.lower() == "content-type" for k, _ in case.headers):
            args += ["-H", "Content-Type:"]
    subprocess.run([*args, base + case.target], check=True, timeout=40)
    blocks = [b for b in head_file.read_bytes().split(b"\r\n\r\n") if b.strip()]
    interim = []
    for block in blocks[:-1]:
        interim.append(int(block.split(b" ", 2)[1]))
    lines = blocks[-1].split(b"\r\n")
    status = int(lines[0].split(b" ", 2)[1])
    headers = [tuple(ln.split(b": ", 1)) for ln in lines[1:] if ln]
    # With -I curl writes the head to the output file too: a HEAD has no body.
    body = body_file.read_bytes() if body_file.exists() and case.method != "HEAD" else b""
    body_file.unlink(missing_ok=True)
    return Reply(status, headers, body, interim)  # type: ignore[arg-type]


_KEPT: dict[str, Any] = {}  # one session per client library for the whole module


def close_clients() -> None:
    for c in _KEPT.values():
        c.close() if hasattr(c, "close") else c.clear()
    _KEPT.clear()


def _via_requests(base: str, case: Case, tmp: Path) -> Reply:
    import requests

    s = _KEPT.get("requests")
    if s is None:
        s = _KEPT["requests"] = requests.Session()
        s.headers.clear()
    data: Any = case.body
    if case.body is not None and case.chunked:
        data = _chunks(case.body)
    r = s.request(
        case.method,
        base + case.target,
        headers=dict(case.headers),
        data=data,
        allow_redirects=False,
        stream=True,
        timeout=30,
    )
    body = r.raw.read(decode_content=False)
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in r.raw.headers.items()]
    r.close()
    return Reply(r.status_code, headers, body)


def _via_urllib3(base: str, case: Case, tmp: Path) -> Reply:
    import urllib3

    pm = _KEPT.get("urllib3")
    if pm is None:
        pm = _KEPT["urllib3"] = urllib3.PoolManager()
    r = pm.request(
        case.method,
        base + case.target,
        headers=dict(case.headers),
        body=_chunks(case.body) if case.body is not None and case.chunked else case.body,
        chunked=case.chunked,
        redirect=False,
        retries=False,
        preload_content=False,
        decode_content=False,
        timeout=30,
    )
    body = r.read(decode_content=False)
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in r.headers.items()]
    r.release_conn()
    return Reply(r.status, headers, body)


def _via_httpx(base: str, case: Case, tmp: Path) -> Reply:
    import httpx

    c = _KEPT.get("httpx")
    if c is None:
        c = _KEPT["httpx"] = httpx.Client(timeout=30)
    content: Any = case.body
    if case.body is not None and case.chunked:
        content = _chunks(case.body)
    req = c.build_request(case.method, base + case.target, content=content)
    for name in ("accept", "accept-encoding", "user-agent"):
        req.headers.pop(name, None)
    for k, v in case.headers:
        req.headers[k] = v
    r = c.send(req, stream=True)
    body = b"".join(r.iter_raw())
    r.close()
    return Reply(r.status_code, list(r.headers.raw), body)


def _via_aiohttp(base: str, case: Case, tmp: Path) -> Reply:
    import aiohttp

    async def go() -> Reply:
        async with aiohttp.ClientSession(
            auto_decompress=False, skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding")
        ) as s:
            data: Any = case.body
            if case.body is not None and case.chunked:

                async def gen() -> Any:
                    for c in _chunks(case.body or b""):
                        yield c

                data = gen()
            async with s.request(
                case.method,
                base + case.target,
                headers=list(case.headers),
                data=data,
                allow_redirects=False,
                timeout=aiohttp.ClientTimeout(total=30),
            ) as r:
                body = await r.read()
                return Reply(r.status, list(r.raw_headers), body)

    return asyncio.run(go())


_CLIENTS = {
    "curl": _via_curl,
    "requests": _via_requests,
    "urllib3": _via_urllib3,
    "httpx": _via_httpx,
    "aiohttp": _via_aiohttp,
}


# -- raw sockets (exact request bytes: HTTP/1.0, pipelining, odd targets) ----------------------


def raw_exchange(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send bytes, read until the server closes; returns everything it sent."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.settimeout(timeout)
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def parse_responses(data: bytes, methods: list[str]) -> list[Reply]:
    """Split a byte stream into its responses (1xx kept as interim statuses of the next)."""
    replies = []
    interim: list[int] = []
    i = 0
    while i < len(methods):
        head, sep, data = data.partition(b"\r\n\r\n")
        if not sep:
            break
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        if 100 <= status < 200:
            interim.append(status)
            continue
        headers = [tuple(ln.split(b": ", 1)) for ln in lines[1:]]
        reply = Reply(status, headers, b"", interim)  # type: ignore[arg-type]
        interim = []
        kind = framing(reply, methods[i])
        if kind == "length":
            n = int(reply.header(b"content-length") or b"0")
            reply.body, data = data[:n], data[n:]
        elif kind == "chunked":
            body = b""
            while True:
                size_line, _, data = data.partition(b"\r\n")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    # trailers (none expected) end with an empty line
                    _, _, data = (
                        data.partition(b"\r\n")
                        if data.startswith(b"\r\n")
                        else (data.partition(b"\r\n\r\n"))
                    )
                    break
                body += data[:size]
                data = data[size + 2 :]
            reply.body = body
        elif kind == "close":
            reply.body, data = data, b""
        replies.append(reply)
        i += 1
    return replies


# -- the real processes ------------------------------------------------------------------------


def free_port() -> int:
    # Below the ephemeral range: polling connect() to an ephemeral port that nothing listens on
    # yet can self-connect and hold the very port a server is about to bind (tests/proc.py).
    return proc_free_port()


def wait_port(
    port: int,
    proc: subprocess.Popen[bytes],
    what: str,
    timeout: float = 20,
    log: Path | None = None,
) -> None:
    """Wait until ``port`` accepts; what the process wrote (its stderr pipe, or ``log``, the
    file it writes to) is in the error when it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            if log is not None:
                err = log.read_text(errors="replace")
            else:
                err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}: {err[-2000:]}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise TimeoutError(f"{what} did not listen on {port}")


def wait_http(
    port: int, path: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30
) -> None:
    """Wait until ``GET path`` is answered 200. A listening port is not readiness: gunicorn's
    master and nginx's master listen before a worker serves (gunicorn's worker has yet to
    import the app), and a request then waits in the backlog for as long as that takes."""
    wait_port(port, proc, what, timeout)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{what} exited with {proc.returncode}: {err[-2000:]}")
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request("GET", path)
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        if time.monotonic() >= deadline:
            raise TimeoutError(f"{what} did not answer GET {path} on {port}")
        time.sleep(0.05)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_gunicorn(
    port: int,
    app: str,
    *options: str,
    ready: str,
    what: str = "gunicorn",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """``app`` under gunicorn with ``options`` on ``port``, once ``GET ready`` answers 200."""
    proc = subprocess.Popen(
        [
            *(sys.executable, "-m", "gunicorn", "--bind", f"127.0.0.1:{port}"),
            *options,
            *("--log-level", "warning", app),
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    wait_http(port, ready, proc, what)
    return proc


def start_gunicorn(port: int) -> subprocess.Popen[bytes]:
    """httpbin (PyPI) under gunicorn's threaded worker, keep-alive on."""
    threaded = ("--worker-class", "gthread", "--threads", "16", "--keep-alive", "30")
    return run_gunicorn(port, "httpbin:app", *threaded, ready="/status/200")


# What every nginx run here has: one worker in the foreground, its files under its root, no
# access log; ``{http}`` is the rest of its http block.
NGINX_MAIN = """
worker_processes 1;
daemon off;
pid {root}/nginx.pid;
error_log {root}/error.log warn;
events {{ worker_connections {connections}; }}
http {{
  access_log off;
  client_body_temp_path {root}/cb; proxy_temp_path {root}/pt; fastcgi_temp_path {root}/ft;
  uwsgi_temp_path {root}/ut; scgi_temp_path {root}/st;
{http}}}
"""


def run_nginx(root: Path, http: str, connections: int = 256) -> subprocess.Popen[bytes]:
    """nginx with ``http`` (the rest of its http block) as ``root``/nginx.conf, its files
    under ``root``; not waited for."""
    conf = root / "nginx.conf"
    conf.write_text(NGINX_MAIN.format(root=root, connections=connections, http=http))
    return subprocess.Popen(
        ["nginx", "-c", str(conf), "-p", str(root)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


NGINX_CONF = """\
  types {{ text/plain txt; application/octet-stream bin; text/html html; }}
  keepalive_timeout 30s;
  if_modified_since before;
  # nginx makes its own redirects absolute with its listen port, which no proxy in front can
  # know (nginx's proxy_redirect rewrites them; the sidecar, like Envoy, does not): apps
  # behind a proxy send relative redirects.
  absolute_redirect off;
  server {{
    listen 127.0.0.1:{port};
    root {root}/www;
    location /ngx/gz/ {{ gzip on; gzip_min_length 1; gzip_types text/plain; }}
    location = /ngx/cookies {{
      add_header Set-Cookie "a=1; Path=/";
      add_header Set-Cookie "b=2; HttpOnly";
      return 200 "cookies\\n";
    }}
    location = /ngx/dup {{ add_header X-Dup one; add_header X-Dup two; return 200 "dup\\n"; }}
    location = /ngx/nocontent {{ return 204; }}
    location = /ngx/moved {{ return 301 /ngx/files/small.txt; }}
    location = /ngx/found {{ return 302 http://example.test/elsewhere; }}
    location = /ngx/teapot {{ return 418 "short and stout\\n"; }}
    location /ngx/ {{ }}
  }}
"""


def start_nginx(port: int, root: Path) -> subprocess.Popen[bytes]:
    www = root / "www" / "ngx"
    (www / "files").mkdir(parents=True)
    (www / "gz").mkdir()
    (www / "files" / "small.txt").write_bytes(b"hello from nginx\n")
    big = bytes(range(256)) * (5 * 1024 * 1024 // 256)  # 5 MiB
    (www / "files" / "big.bin").write_bytes(big)
    (www / "files" / "utf8-ü.txt").write_bytes("ü\n".encode())
    (www / "gz" / "text.txt").write_bytes(b"compress me " * 2000)
    (www / "index.html").write_bytes(b"<p>index</p>\n")
    proc = run_nginx(root, NGINX_CONF.format(root=root, port=port))
    wait_http(port, "/ngx/files/small.txt", proc, "nginx")
    return proc


def sidecar_config(port: int, admin: int, bin_port: int, ngx_port: int) -> str:
    return f"""
version: 1
name: diff-edge
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
limits: {{max_request_body: 8MiB}}
defaults:
  breaker: {{min_sequences: 1000000}}
  budget: {{min_per_second: 1000}}
routes:
  - name: drip
    match: {{path_prefix: /drip}}
    upstream: "http://127.0.0.1:{bin_port}"
    retry: {{per_try_timeout: 200ms}}
  - name: ngx
    match: {{path_prefix: /ngx/}}
    upstream: "http://127.0.0.1:{ngx_port}"
  - name: bin
    upstream: "http://127.0.0.1:{bin_port}"
"""


def start_sidecar(config: Path, port: int) -> subprocess.Popen[bytes]:
    """The real sidecar; its log (an access log line per request by default) goes to a file
    beside its config, never to a pipe nobody reads, which would fill and block it."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    log = config.with_name(config.name + ".log")
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            [sys.executable, "-m", "sidecar", "run", "--config", str(config)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=out,
        )
    wait_port(port, proc, "sidecar", log=log)
    return proc


@dataclass
class World:
    bin_port: int
    ngx_port: int | None
    sidecar_port: int
    tmp: Path


def nginx_available() -> bool:
    return shutil.which("nginx") is not None


def curl_available() -> bool:
    return shutil.which("curl") is not None


def make_tmp() -> Path:
    path = Path(tempfile.mkdtemp(prefix="retry-sidecar-diff-"))
    path.chmod(0o755)  # nginx's workers run as nobody when the tests run as root
    return path


# -- what an upstream received: the request side, sidecar against nginx -----------------------


@dataclass(frozen=True)
class Received:
    """One request as the upstream got it: the body de-chunked, the framing apart."""

    method: str
    target: str
    headers: tuple[tuple[str, str], ...]
    body: bytes
    framing: str  # "length", "chunked" or "none"


class RecordingUpstream:
    """An aiohttp upstream in a thread of its own (the suite's clients are blocking): it
    records every request and answers 200 with the request's size (503 under /dlq/)."""

    def __init__(self, tls: Any = None) -> None:
        import threading

        self.seen: list[Received] = []
        self.port = 0
        self.tls = tls  # an ssl.SSLContext: the same app also over TLS, on tls_port
        self.tls_port = 0
        self.raw_port = 0  # bodiless requests, heads taken as bytes (targets over 0x7F)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise TimeoutError("the recording upstream did not start")

    async def _run(self) -> None:
        from aiohttp import web

        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            body = await request.content.read()  # no size limit (request.read has 1 MiB)
            te = request.headers.get("Transfer-Encoding", "")
            framing_kind = (
                "chunked"
                if "chunked" in te.lower()
                else "length"
                if "Content-Length" in request.headers
                else "none"
            )
            got = Received(
                request.method,
                request.raw_path,
                tuple((k.decode("latin-1"), v.decode("latin-1")) for k, v in request.raw_headers),
                body,
                framing_kind,
            )
            with self._lock:
                self.seen.append(got)
            if request.raw_path.startswith("/dlq/"):
                return web.Response(status=503, body=b"down")  # a DLQ route stores the write
            return web.Response(body=b"%d" % len(body))

        async def raw_heads(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            # Request heads taken as bytes (aiohttp's parser refuses bytes over 0x7F in a
            # target, which nginx passes on): bodiless requests only.
            with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError):
                while True:
                    head = await r.readuntil(b"\r\n\r\n")
                    line, *fields = head[:-4].split(b"\r\n")
                    method, target, _ = line.split(b" ")
                    pairs = tuple(
                        (k.decode("latin-1"), v.strip().decode("latin-1"))
                        for k, _, v in (f.partition(b":") for f in fields)
                    )
                    got = Received(method.decode(), target.decode("latin-1"), pairs, b"", "none")
                    with self._lock:
                        self.seen.append(got)
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
                    await w.drain()
            w.close()

        raw = await asyncio.start_server(raw_heads, "127.0.0.1", 0)
        self.raw_port = raw.sockets[0].getsockname()[1]
        server = web.Server(handle, auto_decompress=False, access_log=None)
        runner = web.ServerRunner(server)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = int(runner.addresses[0][1])
        if self.tls is not None:
            tls_site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=self.tls)
            await tls_site.start()
            self.tls_port = int(runner.addresses[1][1])
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._ready.set()
        await self._stop.wait()
        raw.close()
        await runner.cleanup()

    def take(self) -> list[Received]:
        with self._lock:
            seen, self.seen = self.seen, []
        return seen

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


# Request fields that belong to one hop, or that a proxy adds by contract (docs/headers.md,
# "Deliberate differences"): left out when what reached the upstream is compared.
HOP_REQUEST = {
    "connection",
    "keep-alive",
    "te",
    "transfer-encoding",
    "content-length",
    "expect",
    "proxy-connection",
    "upgrade",
}


def received_comparable(got: Received) -> dict[str, Any]:
    """What must be equal whoever proxied the request (the body whole and de-chunked)."""
    headers = [
        (k.lower(), v)
        for k, v in got.headers
        if k.lower() not in HOP_REQUEST and k.lower() not in REQUEST_ADDITIONS
    ]
    return {
        "method": got.method,
        "target": got.target,
        "headers": headers,
        "size": len(got.body),
        "body": hashlib.sha256(got.body).hexdigest(),
    }


def send_in_pieces(port: int, pieces: list[bytes], timeout: float = 30.0) -> bytes:
    """Write ``pieces`` one by one (TCP_NODELAY, a moment apart, so that each tends to arrive
    in a read of its own), then read until the server closes; returns what it sent."""
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.settimeout(timeout)
        for piece in pieces:
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break  # the server answered and closed: what it sent is read below
            time.sleep(0.001)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except ConnectionResetError:
                return out
            if not chunk:
                return out
            out += chunk


NGINX_PROXY_CONF = """\
  client_max_body_size {max_body};
  keepalive_timeout 30s;
  server {{
    listen 127.0.0.1:{port};
    location /raw/ {{
      proxy_pass http://127.0.0.1:{raw};
      proxy_http_version 1.1;
      proxy_set_header Host $http_host;
      proxy_set_header Connection "";
    }}
    location / {{
      proxy_pass http://127.0.0.1:{upstream};
      proxy_http_version 1.1;
      proxy_set_header Host $http_host;
      proxy_set_header Connection "";
    }}
  }}
"""


NGINX_TLS_PROXY_CONF = """\
  client_max_body_size 16m;
  keepalive_timeout 30s;
  upstream tls_up {{ server 127.0.0.1:{upstream}; keepalive 16; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{
      proxy_pass https://tls_up;
      proxy_http_version 1.1;
      # what `proxy_pass https://localhost:{upstream}` sends by default: the upstream's name
      proxy_set_header Host localhost:{upstream};
      proxy_set_header Connection "";
      proxy_ssl_verify on;
      proxy_ssl_trusted_certificate {ca};
      proxy_ssl_name localhost;
      proxy_ssl_server_name on;
    }}
  }}
"""


def start_nginx_tls_proxy(port: int, upstream: int, ca: str, root: Path) -> subprocess.Popen[bytes]:
    """nginx in the sidecar's place in front of an HTTPS ``upstream``: ``proxy_pass https://``
    with ``proxy_ssl_verify on`` against ``ca``, the name ``localhost``."""
    root.mkdir(parents=True, exist_ok=True)
    proc = run_nginx(root, NGINX_TLS_PROXY_CONF.format(port=port, upstream=upstream, ca=ca))
    wait_port(port, proc, "nginx TLS proxy")
    return proc


def start_nginx_proxy(
    port: int,
    upstream: int,
    raw: int,
    root: Path,
    max_body: str = "16m",
    connections: int = 256,
) -> subprocess.Popen[bytes]:
    """nginx as a reverse proxy in the sidecar's place, in front of ``upstream`` (``raw`` for
    targets under /raw/). ``max_body``: its ``client_max_body_size`` ("0": no limit, as a git
    or package server behind nginx is configured); ``connections``: its worker_connections
    (a proxied request holds two)."""
    root.mkdir(parents=True, exist_ok=True)
    http = NGINX_PROXY_CONF.format(port=port, upstream=upstream, raw=raw, max_body=max_body)
    proc = run_nginx(root, http, connections)
    wait_port(port, proc, "nginx proxy")
    return proc

"""Real TLS peers on loopback for the upstream TLS tests: nginx with ``ssl`` (a good server, a
wrong-name one, an expired one, one that wants a client certificate, one that rejects every
handshake with an alert, one that closes each connection after a request), certificates from
``tests/tlscerts.py``, and a socket that accepts TCP and never answers a ClientHello.

nginx's access log line per request counts the attempts that reached it, with the SNI it saw,
whether the TLS session was resumed and the connection serial number (keep-alive reuse).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests import tlscerts
from tests.difftools import free_port, run_nginx, wait_port
from tests.proc import SidecarProcess

LOG_FORMAT = "$server_port $request_method $request_uri sni=$ssl_server_name reused=$ssl_session_reused conn=$connection proto=$ssl_protocol"

SERVERS = """
  log_format tls '{log_format}';
  keepalive_timeout 30s;
  server {{
    listen 127.0.0.1:{ok} ssl;
    ssl_certificate {server_cert}; ssl_certificate_key {server_key};
    ssl_protocols TLSv1.2 TLSv1.3;
    access_log {root}/ok.log tls;
    location /upgrade {{
      proxy_pass http://127.0.0.1:{ws};
      proxy_http_version 1.1;
      proxy_set_header Upgrade $http_upgrade;
      proxy_set_header Connection "upgrade";
    }}
    location = /ok/503 {{ return 503 "down\\n"; }}
    # a DLQ route's writes: 503 when sent, 201 when replayed (x-retry-replay)
    location /dlq/ {{
      if ($http_x_retry_replay) {{ return 201 "created\\n"; }}
      return 503 "down\\n";
    }}
    location /idem/ {{ return 201 "made $request_id\\n"; }}
    location / {{ return 200 "ok sni=$ssl_server_name\\n"; }}
  }}
  server {{
    listen 127.0.0.1:{churn} ssl;
    ssl_certificate {server_cert}; ssl_certificate_key {server_key};
    ssl_protocols TLSv1.2 TLSv1.3;
    ssl_session_cache shared:churn:1m;
    keepalive_requests 1;
    access_log {root}/churn.log tls;
    location / {{ return 200 "churn\\n"; }}
  }}
  server {{
    listen 127.0.0.1:{wrong} ssl;
    ssl_certificate {wrong_cert}; ssl_certificate_key {wrong_key};
    access_log {root}/wrong.log tls;
    location / {{ return 200 "wrong\\n"; }}
  }}
  server {{
    listen 127.0.0.1:{expired} ssl;
    ssl_certificate {expired_cert}; ssl_certificate_key {expired_key};
    access_log {root}/expired.log tls;
    location / {{ return 200 "expired\\n"; }}
  }}
  server {{
    listen 127.0.0.1:{mtls} ssl;
    ssl_certificate {server_cert}; ssl_certificate_key {server_key};
    ssl_verify_client on; ssl_client_certificate {ca};
    access_log {root}/mtls.log tls;
    location / {{ return 200 "client $ssl_client_s_dn\\n"; }}
  }}
  server {{
    listen 127.0.0.1:{reject} ssl;
    ssl_reject_handshake on;
    access_log {root}/reject.log tls;
  }}
  server {{
    listen 127.0.0.1:{plain};
    access_log {root}/plain.log tls;
    location / {{ return 200 "plain\\n"; }}
  }}
"""


@dataclass
class Peers:
    root: Path
    certs: tlscerts.CertSet
    ports: dict[str, int]
    proc: subprocess.Popen[bytes]
    silent: socket.socket  # accepts TCP (the kernel's backlog), never answers
    closed_port: int  # nothing listens there
    # openssl s_server, TLS 1.3 only, wanting a client certificate: it checks it after the
    # client's side of the handshake is done and refuses with an alert in place of an answer
    s_server: subprocess.Popen[bytes] | None = None
    s_server_port: int = 0
    seen: dict[str, int] = field(default_factory=dict)

    def log(self, name: str) -> list[str]:
        path = self.root / f"{name}.log"
        return path.read_text().splitlines() if path.exists() else []

    def new_lines(self, name: str) -> list[str]:
        """The access log lines of server ``name`` since the last call."""
        lines = self.log(name)
        start = self.seen.get(name, 0)
        self.seen[name] = len(lines)
        return lines[start:]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        if self.s_server is not None:
            self.s_server.terminate()
            self.s_server.wait(10)
        self.silent.close()


def start(root: Path, ws_port: int = 1) -> Peers:
    """nginx with the servers above under ``root`` (mode 755: its workers may run as nobody);
    ``ws_port``: a plaintext WebSocket app the good server proxies /upgrade to."""
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)
    certs = tlscerts.make(root / "certs")
    names = ("ok", "churn", "wrong", "expired", "mtls", "reject", "plain")
    ports = {n: free_port() for n in names}
    http = SERVERS.format(
        log_format=LOG_FORMAT,
        root=root,
        ws=ws_port,
        ca=certs.ca,
        server_cert=certs.server.cert,
        server_key=certs.server.key,
        wrong_cert=certs.wrong_name.cert,
        wrong_key=certs.wrong_name.key,
        expired_cert=certs.expired.cert,
        expired_key=certs.expired.key,
        **ports,
    )
    proc = run_nginx(root, http)
    for n in names:
        wait_port(ports[n], proc, "nginx")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    peers = Peers(root, certs, ports, proc, silent, free_port())
    if shutil.which("openssl") is not None:
        port = free_port()
        peers.s_server_port = port
        cmd = ["openssl", "s_server", "-accept", f"127.0.0.1:{port}", "-tls1_3", "-www"]
        cmd += ["-quiet", "-cert", certs.server.cert, "-key", certs.server.key]
        cmd += ["-CAfile", certs.ca, "-Verify", "1"]
        peers.s_server = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_port(port, peers.s_server, "openssl s_server")
    return peers


@dataclass
class World:
    """The TLS peers, and the real sidecar process in front of them (the upstream TLS tests'
    module fixtures)."""

    peers: Peers
    sidecar: SidecarProcess
    port: int
    admin: int

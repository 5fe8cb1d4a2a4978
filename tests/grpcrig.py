"""The real sidecar process in front of the scriptable gRPC peer (tests/grpcpeers.py), shared by
a test module: one peer, one sidecar (uvloop, as shipped) whose routes each set up one contract
of the gRPC path, told apart by the ``x-route`` request metadata a call sends; calls without it
take the route ``echo`` (``/test.Echo/``, the defaults), other paths match no route.

``stalled`` is an h2 server that sends a call's response headers and then nothing, whatever its
grpc-timeout says. ``silent`` is a listener that never answers (the sidecar's own deadline answer, with no
upstream deadline racing it). Every route speaks h2 to its upstream and retries quickly (1 ms constant backoff), with the
throttle and the breaker off and a budget that allows every retry, so a count of upstream calls
says what the retry policy did, never what a storm control refused."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions

from tests import grpcclient, grpcpeers
from tests.proc import SidecarProcess, free_port, launched

CONFIG = """\
version: 1
listen: "127.0.0.1:{port}"
admin: {{listen: "127.0.0.1:{admin}"}}
dlq: {{path: "{root}/dlq.sqlite3"}}
idempotency: {{path: "{root}/idempotency.sqlite3"}}
defaults:
  upstream_protocol: h2
  throttle: {{enabled: false}}
  breaker: {{enabled: false}}
  budget: {{ratio: 1.0, min_per_second: 1000}}
  retry: {{backoff: {{strategy: constant, base: 1ms, max: 1ms}}}}
routes:
  - name: codes
    match: {{headers: {{x-route: codes}}}}
    upstream: http://127.0.0.1:{peer}
    retry: {{retry_on: [internal, resource-exhausted, cancelled, deadline-exceeded]}}
  - name: short
    match: {{headers: {{x-route: short}}}}
    upstream: http://127.0.0.1:{peer}
    timeout: 700ms
  - name: small
    match: {{headers: {{x-route: small}}}}
    upstream: http://127.0.0.1:{peer}
    retry: {{max_body_bytes: 100}}
  - name: down
    match: {{headers: {{x-route: down}}}}
    upstream: http://127.0.0.1:{dead}
  - name: breaker
    match: {{headers: {{x-route: breaker}}}}
    upstream: http://127.0.0.1:{dead}
    retry: {{attempts: 1}}
    breaker: {{enabled: true, min_sequences: 2, failure_ratio: 0.5, open_for: 30s, max_open_for: 30s}}
  - name: silent
    match: {{headers: {{x-route: silent}}}}
    upstream: http://127.0.0.1:{silent}
    timeout: 500ms
  - name: stalled
    match: {{headers: {{x-route: stalled}}}}
    upstream: http://127.0.0.1:{stalled}
  - name: tripped
    match: {{headers: {{x-route: tripped}}}}
    upstream: http://127.0.0.1:{peer}
    retry: {{attempts: 1}}
    breaker: {{enabled: true, min_sequences: 2, failure_ratio: 0.5, open_for: 30s, max_open_for: 30s}}
  - name: killed
    match: {{headers: {{x-route: killed}}}}
    upstream: http://127.0.0.1:{peer}
  - name: http1
    match: {{headers: {{x-route: http1}}}}
    upstream: http://127.0.0.1:{peer}
    upstream_protocol: http1
  - name: dlq
    match: {{headers: {{x-route: dlq}}}}
    upstream: http://127.0.0.1:{dead}
    dlq: {{enabled: true}}
  - name: guarded
    match: {{headers: {{x-route: guarded}}}}
    upstream: http://127.0.0.1:{peer}
    idempotency: {{enabled: true, required: true}}
  - name: echo
    match: {{path_prefix: /test.Echo/}}
    upstream: http://127.0.0.1:{peer}
"""


@dataclass
class Rig:
    peer: grpcpeers.Peer
    proc: SidecarProcess
    port: int  # the sidecar's listener (h2c with prior knowledge for a gRPC client)
    admin: int  # its admin API

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def call(
        self,
        method: str,
        requests: tuple[bytes, ...] = (b"x",),
        route: str | None = None,
        **kw: Any,
    ) -> grpcclient.Answer:
        """A grpcio call through the sidecar, on ``route`` (its ``x-route``)."""
        meta = tuple(kw.pop("metadata", ()))
        if route is not None:
            meta += (("x-route", route),)
        return grpcclient.call(self.target, method, requests, metadata=meta, **kw)

    def start(
        self,
        method: str,
        requests: tuple[bytes, ...] = (b"x",),
        route: str | None = None,
        **kw: Any,
    ) -> grpcclient.Running:
        meta = (("x-route", route),) if route is not None else ()
        return grpcclient.start(self.target, method, requests, metadata=meta, **kw)

    def admin_call(self, method: str, path: str, body: object = None) -> tuple[int, Any]:
        """One admin API call (no token: a loopback admin without one takes every call)."""
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.admin}{path}", data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
                status = resp.status
        except urllib.error.HTTPError as e:
            raw, status = e.read(), e.code
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode()

    def metric(self, name: str, **labels: str) -> float:
        """The value of one sample of ``/metrics`` (0 when absent)."""
        _, text = self.admin_call("GET", "/metrics")
        want = {f'{k}="{v}"' for k, v in labels.items()}
        total = 0.0
        for line in str(text).splitlines():
            if not line.startswith(name + "{") and not line.startswith(name + " "):
                continue
            inside = line[line.find("{") + 1 : line.rfind("}")] if "{" in line else ""
            if want <= set(inside.split(",")) if inside else not want:
                total += float(line.rsplit(" ", 1)[1])
        return total


@contextmanager
def rig(root: Path) -> Iterator[Rig]:
    """The peer and the sidecar in front of it (files under ``root``); both stopped on every
    exit, the sidecar by its PID."""
    root.mkdir(parents=True, exist_ok=True)
    with grpcpeers.serving() as peer, socket.socket() as silent, stalling() as stalled:
        # An upstream that takes connections (the kernel's backlog) and never answers: only
        # the sidecar's own deadline can end a call to it.
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port, admin, dead = free_port(), free_port(), free_port()
        cfg = root / "sidecar.yaml"
        cfg.write_text(
            CONFIG.format(
                port=port,
                admin=admin,
                root=root,
                peer=peer.port,
                dead=dead,
                silent=silent.getsockname()[1],
                stalled=stalled,
            )
        )
        proc = asyncio.run(launched(cfg, port, admin))
        try:
            yield Rig(peer, proc, port, admin)
        finally:
            proc.terminate()


def _stall(conn: socket.socket) -> None:
    """One connection of ``stalling``: each request gets its response headers, never more."""
    h2c = h2.connection.H2Connection(h2.config.H2Configuration(client_side=False))
    h2c.initiate_connection()
    with conn:
        try:
            conn.sendall(h2c.data_to_send())
            while data := conn.recv(65536):
                for ev in h2c.receive_data(data):
                    if isinstance(ev, h2.events.RequestReceived):
                        fields = [(":status", "200"), ("content-type", "application/grpc")]
                        h2c.send_headers(ev.stream_id, fields)
                    elif isinstance(ev, h2.events.DataReceived):
                        h2c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                conn.sendall(h2c.data_to_send())
        except (OSError, h2.exceptions.H2Error):
            pass


@contextmanager
def stalling() -> Iterator[int]:
    """An h2c server (prior knowledge) that answers each request with its headers and then
    stalls, its deadline ignored; yields its port. Its threads end when it is closed."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conns.append(conn)
            threading.Thread(target=_stall, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()
        for conn in conns:
            conn.close()

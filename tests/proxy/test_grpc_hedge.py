"""gRPC hedging, opt-in as gRFC A6's ``hedgingPolicy``: a route that turns hedging on and lists
POST in ``hedge.methods`` hedges its gRPC calls (a plain HTTP POST on it never:
``engine/sequence.py`` hedges a POST only when it is a gRPC call), through the
real sidecar and a real grpcio server."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from tests import grpcclient
from tests.grpcpeers import UNARY, Peer, Step, serving
from tests.proc import SidecarProcess, free_port, launched

OK = grpc.StatusCode.OK
ROUTE = """\
    upstream_protocol: h2
    hedge: {{enabled: true, methods: [GET, POST]}}
    retry: {{attempts: 2, auto_timeout: {{min: 50ms, max: 200ms}}}}
"""


@contextmanager
def hedging(tmp_path: Path) -> Iterator[tuple[Peer, int]]:
    with serving() as peer:
        port, admin = free_port(), free_port()
        cfg = tmp_path / "sidecar.yaml"
        cfg.write_text(
            f"version: 1\nlisten: 127.0.0.1:{port}\nadmin: {{listen: 127.0.0.1:{admin}}}\n"
            f"routes:\n  - name: g\n    upstream: http://127.0.0.1:{peer.port}\n" + ROUTE.format()
        )
        proc: SidecarProcess = asyncio.run(launched(cfg, port, admin))
        try:
            yield peer, port
        finally:
            proc.terminate()


def test_a_slow_grpc_call_is_hedged_on_a_route_that_lists_post(tmp_path: Path) -> None:
    with hedging(tmp_path) as (peer, port):
        target = f"127.0.0.1:{port}"
        for _ in range(20):  # the route's latency estimate learns fast answers
            assert grpcclient.call(target, UNARY).code == OK
        peer.plan(Step(delay=1.0), method=UNARY)  # one slow attempt arms hedging
        assert grpcclient.call(target, UNARY).code == OK
        peer.reset()
        peer.plan(Step(delay=3.0), method=UNARY)  # the next original is slow: its hedge wins
        answer = grpcclient.call(target, UNARY, (b"h",))
        assert answer.code == OK and answer.messages == (b"h",)
        fields = dict((*answer.initial, *answer.trailing))
        assert fields.get("x-retry-hedges") == "1"
        # the slow original lost: its call is cancelled upstream
        assert len(peer.calls) == 2
        assert peer.calls[0].ended.wait(5) and peer.calls[0].cancelled

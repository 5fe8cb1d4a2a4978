"""The gRPC tests' peers (tests/grpcpeers.py, tests/grpcclient.py) checked on their own, with no
sidecar: each method and each scripted outcome reaches a grpcio client as scripted, directly and
through nginx's ``grpc_pass`` (the reference the sidecar's gRPC path is compared with), and the
two agree on the status, its details, the messages and the trailers. The wire shape (Trailers-Only
for an early failure) is read with the raw h2 client, and the server records what the sidecar's
tests will read: request metadata, the deadline, the request messages, a cancellation."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from tests import difftools, grpcclient, grpcpeers
from tests.grpcpeers import BIDI, CLIENT_STREAM, SERVER_STREAM, UNARY, Step
from tests.wait import BOUND

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
PUSHBACK = (("grpc-retry-pushback-ms", "250"),)
REQUESTS = (b"one", b"two", b"three")


def until(condition: Callable[[], object], what: str) -> None:
    """tests.wait.until for these blocking tests: poll, fail after BOUND s."""
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


@dataclass
class Peers:
    peer: grpcpeers.Peer
    nginx: int  # nginx grpc_pass's port, in front of the peer

    def target(self, via: str) -> str:
        return self.peer.target if via == "direct" else f"127.0.0.1:{self.nginx}"

    def port(self, via: str) -> int:
        return self.peer.port if via == "direct" else self.nginx


@pytest.fixture(scope="module")
def module_peers() -> Iterator[Peers]:
    if not difftools.nginx_available():
        pytest.skip("nginx is not installed: it is the gRPC reference")
    with (
        grpcpeers.serving() as peer,
        grpcpeers.nginx_grpc(difftools.make_tmp(), peer.port) as nginx,
    ):
        yield Peers(peer, nginx)


@pytest.fixture
def peers(module_peers: Peers) -> Peers:
    module_peers.peer.reset()
    return module_peers


# What nginx adds to an answer: its server and date headers, and content-length: 0 on a
# Trailers-Only one. grpcio hands a Trailers-Only answer's fields over as trailing metadata.
ADDED = {"server", "date", "content-length"}


def trailing(answer: grpcclient.Answer) -> tuple[tuple[str, str | bytes], ...]:
    return tuple((k, v) for k, v in answer.trailing if k not in ADDED)


def seen(answer: grpcclient.Answer) -> tuple[object, ...]:
    """What a client sees that the proxy must not change (the initial metadata is left out:
    nginx adds its own server and date)."""
    return answer.code, answer.details, answer.messages, trailing(answer)


@pytest.mark.parametrize("method", grpcpeers.METHODS)
def test_each_method_answers_alike_direct_and_through_nginx(peers: Peers, method: str) -> None:
    want = {
        UNARY: (b"one",),
        SERVER_STREAM: (b"one#0", b"one#1", b"one#2"),
        CLIENT_STREAM: (b"onetwothree",),
        BIDI: REQUESTS,
    }[method]
    got = {}
    for via in ("direct", "nginx"):
        answer = grpcclient.call(peers.target(via), method, REQUESTS, pingpong=method == BIDI)
        assert (answer.code, answer.messages) == (grpc.StatusCode.OK, want), via
        got[via] = seen(answer)
        call = peers.peer.calls[-1]
        assert call.method == method
        assert call.requests == list(REQUESTS[: 1 if method in (UNARY, SERVER_STREAM) else 3])
        assert call.ended.wait(BOUND) and not call.cancelled
    assert got["direct"] == got["nginx"]


# (method, plan, how many calls, the codes and message counts the client sees, in order)
SCRIPTS = [
    pytest.param(UNARY, grpcpeers.fail(UNAVAILABLE, 2), [(14, 0), (14, 0), (0, 1)], id="unary-2x"),
    pytest.param(
        SERVER_STREAM, [Step(code=UNAVAILABLE, messages=1)], [(14, 1), (0, 3)], id="stream-after-1"
    ),
    pytest.param(
        CLIENT_STREAM, grpcpeers.fail(grpc.StatusCode.INTERNAL), [(13, 0), (0, 1)], id="client-in"
    ),
    pytest.param(
        BIDI, [Step(code=grpc.StatusCode.RESOURCE_EXHAUSTED, messages=2)], [(8, 2)], id="bidi-2"
    ),
    pytest.param(UNARY, grpcpeers.fail(UNAVAILABLE, trailers=PUSHBACK), [(14, 0)], id="pushback"),
    pytest.param(
        SERVER_STREAM,
        [Step(code=grpc.StatusCode.ABORTED, headers_first=True, trailers=PUSHBACK)],
        [(10, 0)],
        id="headers-first",
    ),
]


@pytest.mark.parametrize(("method", "plan", "want"), SCRIPTS)
def test_scripted_outcomes_reach_the_client_alike_direct_and_through_nginx(
    peers: Peers, method: str, plan: list[Step], want: list[tuple[int, int]]
) -> None:
    answers = {}
    for via in ("direct", "nginx"):
        peers.peer.plan(plan, method=method)
        answers[via] = [
            grpcclient.call(peers.target(via), method, REQUESTS, pingpong=method == BIDI)
            for _ in want
        ]
        codes = [(a.code.value[0], len(a.messages)) for a in answers[via]]
        assert codes == want, via
        for step, answer in zip(plan, answers[via], strict=False):
            assert answer.details == step.details
            assert trailing(answer) == step.trailers
    assert [seen(a) for a in answers["direct"]] == [seen(a) for a in answers["nginx"]]
    assert len(peers.peer.calls_to(method)) == 2 * len(want)


@pytest.mark.parametrize("via", ["direct", "nginx"])
def test_an_early_failure_is_trailers_only_and_a_late_one_is_not(peers: Peers, via: str) -> None:
    peers.peer.plan(grpcpeers.fail(UNAVAILABLE, trailers=PUSHBACK), method=UNARY)
    early = grpcclient.raw_call(peers.port(via), UNARY)
    assert early.trailers_only and early.status == "14" and early.data == b""
    assert ("grpc-retry-pushback-ms", "250") in early.headers
    peers.peer.plan(Step(code=UNAVAILABLE, messages=1), method=SERVER_STREAM)
    late = grpcclient.raw_call(peers.port(via), SERVER_STREAM)
    assert not late.trailers_only and late.status == "14" and late.messages == [b"x#0"]
    peers.peer.plan(Step(code=UNAVAILABLE, headers_first=True), method=SERVER_STREAM)
    headers_first = grpcclient.raw_call(peers.port(via), SERVER_STREAM)
    assert not headers_first.trailers_only and headers_first.messages == []
    assert headers_first.status == "14"


@pytest.mark.parametrize("via", ["direct", "nginx"])
def test_the_server_sees_previous_attempts_and_the_deadline(peers: Peers, via: str) -> None:
    """grpc-previous-rpc-attempts is in the server's metadata when a client sends it (the raw
    client; grpcio's with its retries off, as grpcclient's channels are: with them on, grpcio's
    retry layer owns the header and drops one given as metadata); grpc-timeout is never
    metadata but the call's deadline: time_remaining."""
    grpcclient.raw_call(
        peers.port(via),
        UNARY,
        headers=[("grpc-previous-rpc-attempts", "2"), ("grpc-timeout", "3S"), ("x-app", "a")],
    )
    raw = peers.peer.calls[-1]
    assert raw.header("grpc-previous-rpc-attempts") == "2" and raw.header("x-app") == "a"
    assert raw.header("grpc-timeout") is None
    assert raw.time_remaining is not None and 0 < raw.time_remaining <= 3
    meta = (("grpc-previous-rpc-attempts", "1"), ("x-app", "b"))
    answer = grpcclient.call(peers.target(via), UNARY, timeout=7, metadata=meta)
    assert answer.code == grpc.StatusCode.OK
    sent = peers.peer.calls[-1]
    assert sent.header("x-app") == "b" and sent.header("grpc-previous-rpc-attempts") == "1"
    # grpcio's client rounds the grpc-timeout it sends up: the server sees about 7.01 s left
    assert sent.time_remaining is not None and 3 < sent.time_remaining <= 7.5
    no_deadline = grpcclient.call(peers.target(via), UNARY, timeout=None)
    assert no_deadline.code == grpc.StatusCode.OK and peers.peer.calls[-1].time_remaining is None


@pytest.mark.parametrize("via", ["direct", "nginx"])
@pytest.mark.parametrize("method", grpcpeers.METHODS)
def test_a_client_cancel_half_way_reaches_the_server(peers: Peers, via: str, method: str) -> None:
    # streams: one message, then a long gap; unary and client stream: a long delay
    long = Step(gap=30) if method in (SERVER_STREAM, BIDI) else Step(delay=30)
    peers.peer.plan(long, method=method)
    running = grpcclient.start(peers.target(via), method, REQUESTS)
    first = 1 if method in (SERVER_STREAM, BIDI) else 0
    until(lambda: peers.peer.calls and len(running.messages) >= first, "the call under way")
    running.cancel()
    assert running.result().code == grpc.StatusCode.CANCELLED
    call = peers.peer.calls[-1]
    assert call.ended.wait(BOUND), "the server never saw the call end"
    assert call.cancelled


@pytest.mark.parametrize("via", ["direct", "nginx"])
def test_a_deadline_past_ends_the_call_on_both_sides(peers: Peers, via: str) -> None:
    peers.peer.plan(Step(delay=30), method=UNARY)
    answer = grpcclient.call(peers.target(via), UNARY, timeout=0.3)
    assert answer.code == grpc.StatusCode.DEADLINE_EXCEEDED
    call = peers.peer.calls[-1]
    assert call.ended.wait(BOUND) and call.cancelled

"""gRPC through the real sidecar process (issue 32), with a real grpcio client and server
(tests/grpcrig.py): the sidecar's own answers as gRPC statuses (Trailers-Only, seen by grpcio
and on the wire), client and bidirectional streams (kept for a retry while they fit), a cancel
half-way reaching the upstream with nothing left held, ``grpc_calls_total``, and a gRPC call
never kept in the DLQ nor guarded by the idempotency guard."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable

import grpc
import pytest

from sidecar import outcomes
from tests import grpcclient
from tests.grpcpeers import BIDI, CLIENT_STREAM, METHODS, SERVER_STREAM, UNARY, Step, fail
from tests.grpcrig import Rig
from tests.wait import BOUND

OK = grpc.StatusCode.OK
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
GRPC_CALLS = "retry_sidecar_grpc_calls_total"


def until(condition: Callable[[], object], what: str) -> None:
    deadline = time.monotonic() + BOUND
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def field(answer: grpcclient.Answer, name: str) -> str | bytes | None:
    return next((v for k, v in (*answer.initial, *answer.trailing) if k == name), None)


def http_post(rig: Rig, route: str, body: bytes = b"{}") -> tuple[int, dict[str, str]]:
    """A plain HTTP/1.1 POST to the sidecar (the control: what a non-gRPC write gets)."""
    req = urllib.request.Request(f"http://{rig.target}/orders", body, method="POST")
    req.add_header("x-route", route)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, dict(resp.headers)
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers)


# -- 5. the sidecar's own answers ----------------------------------------------------------------

OWN = [
    # (route, gRPC status, x-retry-proxy-error, what grpc-message says)
    pytest.param("down", UNAVAILABLE, outcomes.CONNECT_FAILURE.code, "", id="connect-failure"),
    pytest.param("http1", UNAVAILABLE, None, "upstream_protocol", id="route-not-h2"),
    pytest.param("silent", grpc.StatusCode.DEADLINE_EXCEEDED, outcomes.DEADLINE.code, "", id="dl"),
]


@pytest.mark.parametrize(("route", "code", "error", "says"), OWN)
def test_the_sidecars_own_answer_is_a_grpc_status(
    rig: Rig, route: str, code: grpc.StatusCode, error: str | None, says: str
) -> None:
    answer = rig.call(UNARY, route=route, timeout=None)
    assert answer.code == code
    assert says in answer.details
    if error is not None:
        assert answer.trailer("x-retry-proxy-error") == error
    raw = grpcclient.raw_call(rig.port, UNARY, headers=[("x-route", route)])
    assert raw.trailers_only and ("content-type", "application/grpc") in raw.headers
    assert raw.headers[0] == (":status", "200")
    assert raw.status == str(code.value[0])
    assert any(k == "grpc-message" and says in v for k, v in raw.headers)
    assert any(k.startswith("x-retry-") for k, _ in raw.headers)
    assert rig.peer.calls == []


def test_no_route_is_unimplemented(rig: Rig) -> None:
    answer = grpcclient.call(rig.target, "/other.Svc/Method", kind="unary")
    assert answer.code == grpc.StatusCode.UNIMPLEMENTED
    raw = grpcclient.raw_call(rig.port, "/other.Svc/Method")
    assert raw.trailers_only and raw.status == "12" and raw.headers[0] == (":status", "200")
    assert ("x-retry-proxy-error", outcomes.BAD_REQUEST.code) in raw.headers


def calls_until_the_breaker_opens(rig: Rig, route: str) -> None:
    """Calls on ``route``, each answered UNAVAILABLE, until its breaker answers (at most 10)."""
    seen = []
    for _ in range(10):
        answer = rig.call(UNARY, route=route)
        assert answer.code == UNAVAILABLE
        seen.append(answer.trailer("x-retry-proxy-error"))
        if seen[-1] == outcomes.BREAKER_OPEN.code:
            break
    assert seen[-1] == outcomes.BREAKER_OPEN.code, seen


def test_an_open_breaker_answers_unavailable(rig: Rig) -> None:
    """Two connect failures open the route's breaker (min_sequences 2): then its own answer."""
    calls_until_the_breaker_opens(rig, "breaker")
    raw = grpcclient.raw_call(rig.port, UNARY, headers=[("x-route", "breaker")])
    assert raw.trailers_only and raw.status == "14"
    assert ("x-retry-proxy-error", outcomes.BREAKER_OPEN.code) in raw.headers


def test_a_listed_grpc_status_counts_for_the_breaker(rig: Rig) -> None:
    """UNAVAILABLE from the upstream (listed) opens the breaker as a listed 503 does; a status
    not listed (NOT_FOUND: the upstream working as intended) is no failure."""
    rig.peer.plan(fail(grpc.StatusCode.NOT_FOUND, 4))
    for _ in range(4):
        assert rig.call(UNARY, route="tripped").code == grpc.StatusCode.NOT_FOUND
    _, breakers = rig.admin_call("GET", "/breakers")
    assert breakers["routes"]["tripped"]["failures"] == 0
    rig.peer.plan(fail(UNAVAILABLE, 10))
    calls_until_the_breaker_opens(rig, "tripped")


def test_a_kill_switch_ends_a_call_waiting_for_its_retry_with_unavailable(rig: Rig) -> None:
    scope = "route:killed"
    rig.peer.plan(fail(UNAVAILABLE, trailers=(("grpc-retry-pushback-ms", "20000"),)))
    running = rig.start(UNARY, route="killed", timeout=None)
    try:
        until(lambda: rig.peer.calls, "the first attempt")
        status, body = rig.admin_call(
            "PUT", "/killswitch", {"scope": scope, "ttl": "1m", "reason": "test"}
        )
        assert status == 200, body
        answer = running.result()
        assert answer.code == UNAVAILABLE
        assert answer.trailer("x-retry-proxy-error") == outcomes.KILL_SWITCH.code
        assert len(rig.peer.calls) == 1
        # and with the switch on, a failure is relayed after one attempt
        rig.peer.plan(fail(UNAVAILABLE, 2))
        again = rig.call(UNARY, route="killed")
        assert again.code == UNAVAILABLE and len(rig.peer.calls) == 2
        assert field(again, "x-retry-fate") == "kill-switch"
    finally:
        running.cancel()
        rig.admin_call("DELETE", f"/killswitch?scope={scope}")


# -- 6. streams ----------------------------------------------------------------------------------

REQUESTS = (b"one", b"two", b"three")


def test_a_client_stream_goes_through(rig: Rig) -> None:
    answer = rig.call(CLIENT_STREAM, REQUESTS)
    assert (answer.code, answer.messages) == (OK, (b"onetwothree",))
    assert rig.peer.calls[0].requests == list(REQUESTS)


def test_a_bidi_ping_pong_goes_through(rig: Rig) -> None:
    answer = rig.call(BIDI, REQUESTS, pingpong=True)
    assert (answer.code, answer.messages) == (OK, REQUESTS)
    assert rig.peer.calls[0].requests == list(REQUESTS)


def test_a_small_client_stream_is_retried_whole(rig: Rig) -> None:
    """Three messages of 10 bytes fit the route's 100-byte retry buffer."""
    small = (b"a" * 10, b"b" * 10, b"c" * 10)
    rig.peer.plan(fail(UNAVAILABLE), method=CLIENT_STREAM)
    answer = rig.call(CLIENT_STREAM, small, route="small")
    assert (answer.code, answer.messages) == (OK, (b"".join(small),))
    assert [c.requests for c in rig.peer.calls] == [list(small), list(small)]


def test_a_client_stream_over_the_retry_buffer_is_sent_once(rig: Rig) -> None:
    big = tuple(bytes([65 + i]) * 60 for i in range(5))  # 300 bytes and their framing
    rig.peer.plan(fail(UNAVAILABLE, 2), method=CLIENT_STREAM)
    answer = rig.call(CLIENT_STREAM, big, route="small")
    assert answer.code == UNAVAILABLE
    assert len(rig.peer.calls) == 1 and rig.peer.calls[0].requests == list(big)


# -- 7. cancellation -----------------------------------------------------------------------------


def held(rig: Rig) -> tuple[int, int, int]:
    """(requests in flight on every route, upstream HTTP/2 streams open (connections not
    idle), the sidecar's asyncio tasks)."""
    _, breakers = rig.admin_call("GET", "/breakers")
    in_flight = sum(r["in_flight"] for r in breakers["routes"].values())
    _, stats = rig.admin_call("GET", "/stats")
    pools = [p for name, p in stats["pool"].items() if name.endswith(" h2")]
    return in_flight, sum(p["total"] - p["idle"] for p in pools), stats["asyncio_tasks"]


@pytest.mark.parametrize("method", METHODS)
def test_a_cancel_half_way_reaches_the_upstream_and_nothing_stays_held(
    rig: Rig, method: str
) -> None:
    long = Step(gap=30) if method in (SERVER_STREAM, BIDI) else Step(delay=30)
    rig.peer.plan(long, method=method)
    tasks_before = held(rig)[2]
    cancelled_before = rig.metric(GRPC_CALLS, route="echo", code="CANCELLED")
    running = rig.start(method, REQUESTS)
    first = 1 if method in (SERVER_STREAM, BIDI) else 0
    until(lambda: rig.peer.calls and len(running.messages) >= first, "the call under way")
    in_flight, streams, _ = held(rig)
    assert in_flight == 1 and streams == 1
    running.cancel()
    assert running.result().code == grpc.StatusCode.CANCELLED
    call = rig.peer.calls[0]
    assert call.ended.wait(BOUND), "the upstream never saw the call end"
    assert call.cancelled
    until(
        lambda: held(rig)[:2] == (0, 0) and held(rig)[2] <= tasks_before,
        "the request, its upstream stream and its tasks given back",
    )
    assert len(rig.peer.calls) == 1
    assert rig.metric(GRPC_CALLS, route="echo", code="CANCELLED") == cancelled_before + 1


def test_a_cancel_while_waiting_for_a_pushback_ends_the_wait(rig: Rig) -> None:
    rig.peer.plan(fail(UNAVAILABLE, trailers=(("grpc-retry-pushback-ms", "20000"),)))
    tasks_before = held(rig)[2]
    running = rig.start(UNARY, timeout=None)  # the route's 60 s: room for the wait
    until(lambda: rig.peer.calls, "the first attempt")
    until(lambda: held(rig)[:2] == (1, 0), "the call waiting for its retry")
    running.cancel()
    assert running.result().code == grpc.StatusCode.CANCELLED
    until(
        lambda: held(rig)[:2] == (0, 0) and held(rig)[2] <= tasks_before,
        "the request and its tasks given back",
    )
    assert len(rig.peer.calls) == 1


# -- 8. metrics, never DLQ'd, never guarded ------------------------------------------------------


def test_grpc_calls_total_counts_the_final_status(rig: Rig) -> None:
    def count(route: str, code: str) -> float:
        return rig.metric(GRPC_CALLS, route=route, code=code)

    before = {
        k: count(*k)
        for k in (
            ("echo", "OK"),
            ("echo", "NOT_FOUND"),
            ("echo", "UNAVAILABLE"),
            ("down", "UNAVAILABLE"),
        )
    }
    rig.peer.plan(fail(UNAVAILABLE))  # retried: counted once, as OK
    assert rig.call(UNARY).code == OK
    rig.peer.plan(fail(grpc.StatusCode.NOT_FOUND))
    assert rig.call(UNARY).code == grpc.StatusCode.NOT_FOUND
    rig.peer.plan(Step(code=UNAVAILABLE, messages=1), method=SERVER_STREAM)  # in the trailers
    assert rig.call(SERVER_STREAM).code == UNAVAILABLE
    assert rig.call(UNARY, route="down").code == UNAVAILABLE  # the sidecar's own answer
    after = {k: count(*k) for k in before}
    assert {k: after[k] - before[k] for k in before} == {
        ("echo", "OK"): 1,
        ("echo", "NOT_FOUND"): 1,
        ("echo", "UNAVAILABLE"): 1,
        ("down", "UNAVAILABLE"): 1,
    }


def test_a_failed_grpc_call_is_never_kept_in_the_dlq(rig: Rig) -> None:
    answer = rig.call(UNARY, route="dlq")
    assert answer.code == UNAVAILABLE
    assert field(answer, "x-retry-dlq") is None
    status, body = rig.admin_call("GET", "/dlq?route=dlq")
    assert status == 200 and body["records"] == []
    # the control: the same route keeps a failed HTTP write
    code, headers = http_post(rig, "dlq")
    assert code >= 500 and "x-retry-dlq" in {k.lower() for k in headers}
    status, body = rig.admin_call("GET", "/dlq?route=dlq")
    assert [r["method"] for r in body["records"]] == ["POST"]


def test_a_grpc_call_is_never_guarded(rig: Rig) -> None:
    """The route requires an Idempotency-Key of a write: a gRPC call passes without one."""
    code, _ = http_post(rig, "guarded")
    assert code == 400  # the control: an HTTP POST without a key is refused
    answer = rig.call(UNARY, (b"g",), route="guarded")
    assert (answer.code, answer.messages) == (OK, (b"g",))
    rig.peer.plan(fail(UNAVAILABLE))
    assert rig.call(UNARY, route="guarded").code == OK
    assert len(rig.peer.calls) == 3

"""gRPC retries through the real sidecar process (issue 32, gRFC A6), with a real grpcio client
and server (tests/grpcrig.py): which codes are retried, ``grpc-previous-rpc-attempts``, the
commit point of a server stream, ``grpc-timeout`` in and out, server pushback, and 100 calls at
once on one channel. The upstream's record of each call (its metadata, the time left it saw,
whether it was cancelled) is what a test reads, never a timing."""

from __future__ import annotations

import grpc
import pytest

from sidecar import outcomes
from tests import grpcclient
from tests.grpcpeers import SERVER_STREAM, UNARY, Step, fail
from tests.grpcrig import Rig
from tests.wait import BOUND

OK = grpc.StatusCode.OK
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
ATTEMPTS = "grpc-previous-rpc-attempts"


def previous(rig: Rig) -> list[str | bytes | None]:
    return [c.header(ATTEMPTS) for c in rig.peer.calls]


def initial(answer: grpcclient.Answer, name: str) -> str | bytes | None:
    """A field of the answer's headers (initial metadata, or a Trailers-Only answer's)."""
    return next((v for k, v in (*answer.initial, *answer.trailing) if k == name), None)


# -- 1. which codes are retried ------------------------------------------------------------------


def test_unavailable_is_retried_by_default_and_each_retry_counts_the_attempts_before(
    rig: Rig,
) -> None:
    rig.peer.plan(fail(UNAVAILABLE, 2), method=UNARY)
    answer = rig.call(UNARY, (b"hello",))
    assert (answer.code, answer.messages) == (OK, (b"hello",))
    assert len(rig.peer.calls) == 3
    assert previous(rig) == [None, "1", "2"]
    assert [c.requests for c in rig.peer.calls] == [[b"hello"]] * 3
    assert initial(answer, "x-retry-attempts") == "3"


def test_unavailable_every_time_reaches_the_client_after_the_attempts(rig: Rig) -> None:
    rig.peer.plan(fail(UNAVAILABLE, 3), method=UNARY)
    answer = rig.call(UNARY)
    assert (answer.code, answer.details) == (UNAVAILABLE, "scripted unavailable")
    assert len(rig.peer.calls) == 3
    assert initial(answer, "x-retry-fate") == "exhausted"


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
    ],
)
def test_a_route_listing_a_grpc_status_retries_it(rig: Rig, code: grpc.StatusCode) -> None:
    rig.peer.plan(fail(code), method=UNARY)
    answer = rig.call(UNARY, route="codes")
    assert (answer.code, answer.messages) == (OK, (b"x",))
    assert len(rig.peer.calls) == 2
    assert previous(rig) == [None, "1"]


@pytest.mark.parametrize(
    ("route", "code"),
    [
        (None, grpc.StatusCode.INVALID_ARGUMENT),
        (None, grpc.StatusCode.NOT_FOUND),
        (None, grpc.StatusCode.INTERNAL),  # not in the default list
        (None, grpc.StatusCode.RESOURCE_EXHAUSTED),
        ("codes", grpc.StatusCode.UNAVAILABLE),  # a route's own list replaces the default
        ("codes", grpc.StatusCode.PERMISSION_DENIED),
    ],
)
def test_a_status_not_listed_is_relayed_after_one_call(
    rig: Rig, route: str | None, code: grpc.StatusCode
) -> None:
    rig.peer.plan(fail(code, 3), method=UNARY)
    answer = rig.call(UNARY, route=route)
    assert (answer.code, answer.details) == (code, f"scripted {code.name.lower()}")
    assert len(rig.peer.calls) == 1


def test_the_clients_own_previous_attempts_go_to_the_first_attempt(rig: Rig) -> None:
    rig.peer.plan(fail(UNAVAILABLE), method=UNARY)
    answer = rig.call(UNARY, metadata=((ATTEMPTS, "2"),))
    assert answer.code == OK
    first, retry = previous(rig)
    assert first == "2"
    assert isinstance(retry, str) and retry.isdigit() and int(retry) >= 1


# -- 2. the commit point -------------------------------------------------------------------------


def test_a_server_stream_failing_after_its_first_message_is_committed(rig: Rig) -> None:
    rig.peer.plan(Step(code=UNAVAILABLE, details="late", messages=1), method=SERVER_STREAM)
    answer = rig.call(SERVER_STREAM, (b"s",))
    assert (answer.code, answer.details, answer.messages) == (UNAVAILABLE, "late", (b"s#0",))
    assert len(rig.peer.calls) == 1


def test_a_failure_in_trailers_before_any_message_is_retried(rig: Rig) -> None:
    """Headers, then trailers with UNAVAILABLE and no message: not committed (A6)."""
    rig.peer.plan(Step(code=UNAVAILABLE, headers_first=True), method=SERVER_STREAM)
    answer = rig.call(SERVER_STREAM, (b"s",))
    assert (answer.code, answer.messages) == (OK, (b"s#0", b"s#1", b"s#2"))
    assert len(rig.peer.calls) == 2


def test_a_trailers_only_failure_is_retried_and_the_client_sees_only_the_retry(rig: Rig) -> None:
    rig.peer.plan(fail(UNAVAILABLE), method=UNARY)
    raw = grpcclient.raw_call(rig.port, UNARY, (b"r",))
    assert not raw.trailers_only and raw.status == "0" and raw.messages == [b"r"]
    assert len(rig.peer.calls) == 2


# -- 3. grpc-timeout -----------------------------------------------------------------------------


def test_the_upstream_gets_the_time_left_of_the_clients_deadline(rig: Rig) -> None:
    rig.peer.plan(fail(UNAVAILABLE), method=UNARY)
    answer = rig.call(UNARY, timeout=2.0)
    assert answer.code == OK
    left = [c.time_remaining for c in rig.peer.calls]
    assert all(t is not None for t in left), left
    first, retry = left
    assert first is not None and retry is not None
    assert 0 < retry <= first <= 2.05  # grpcio rounds the grpc-timeout it sends up a little


def test_the_route_timeout_bounds_the_upstreams_deadline_when_smaller(rig: Rig) -> None:
    answer = rig.call(UNARY, route="short", timeout=30.0)
    assert answer.code == OK
    left = rig.peer.calls[0].time_remaining
    assert left is not None and 0 < left <= 0.7


def test_a_server_stream_without_a_deadline_outlives_the_route_timeout(rig: Rig) -> None:
    """The ``short`` route's timeout (700 ms) bounds the wait for the answer's head; a stream
    whose messages keep coming for longer is relayed whole, never cut by it."""
    rig.peer.plan(Step(messages=5, gap=0.3), method=SERVER_STREAM)
    answer = rig.call(SERVER_STREAM, (b"s",), route="short", timeout=None)
    assert answer.code == OK and len(answer.messages) == 5
    assert rig.peer.calls[0].time_remaining is None


def test_a_call_without_a_deadline_sends_none_upstream(rig: Rig) -> None:
    """No grpc-timeout: the upstream gets none (the route's timeout bounds the wait for the
    answer's head only, as for any request: a long server stream is never cut by it)."""
    assert rig.call(UNARY, timeout=None).code == OK
    assert rig.peer.calls[0].time_remaining is None


def test_past_the_route_timeout_the_client_gets_the_sidecars_deadline_exceeded(rig: Rig) -> None:
    """An upstream that never answers: the route's 500 ms pass (the client has no deadline of
    its own) and the sidecar answers DEADLINE_EXCEEDED itself."""
    answer = rig.call(UNARY, route="silent", timeout=None)
    assert answer.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert answer.trailer("x-retry-proxy-error") == outcomes.DEADLINE.code


def test_past_a_grpc_timeout_a_raw_client_gets_a_trailers_only_deadline(rig: Rig) -> None:
    raw = grpcclient.raw_call(
        rig.port, UNARY, headers=[("grpc-timeout", "300m"), ("x-route", "silent")]
    )
    assert raw.trailers_only and raw.status == "4"
    assert ("x-retry-proxy-error", outcomes.DEADLINE.code) in raw.headers
    assert ("x-retry-fate", "deadline") in raw.headers


def test_past_the_deadline_a_slow_upstreams_call_is_ended(rig: Rig) -> None:
    """The upstream got the time left as its own deadline: whichever side's timer fires first,
    the client gets DEADLINE_EXCEEDED and the upstream's call is over."""
    rig.peer.plan(Step(delay=30), method=UNARY)
    answer = rig.call(UNARY, route="short", timeout=None)
    assert answer.code == grpc.StatusCode.DEADLINE_EXCEEDED
    call = rig.peer.calls[0]
    assert call.ended.wait(BOUND) and call.cancelled
    assert len(rig.peer.calls) == 1


def test_past_a_grpc_timeout_an_upstream_that_sent_its_headers_is_cut(rig: Rig) -> None:
    """An upstream that sent its response headers and then nothing, its grpc-timeout ignored:
    the call's deadline still ends the call with DEADLINE_EXCEEDED (not the route's 60 s
    stream idle timeout)."""
    raw = grpcclient.raw_call(
        rig.port, UNARY, headers=[("grpc-timeout", "500m"), ("x-route", "stalled")]
    )
    assert raw.status == "4", raw


def test_past_a_grpc_timeout_a_stream_that_sent_its_headers_still_ends(rig: Rig) -> None:
    """The upstream sent its headers and then nothing: the call's deadline still ends it with
    DEADLINE_EXCEEDED, not the route's 60 s stream idle timeout."""
    rig.peer.plan(Step(delay=30, headers_first=True), method=SERVER_STREAM)
    raw = grpcclient.raw_call(rig.port, SERVER_STREAM, headers=[("grpc-timeout", "500m")])
    assert raw.status == "4", raw
    call = rig.peer.calls[0]
    assert call.ended.wait(BOUND) and call.cancelled


@pytest.mark.parametrize("value", ["abc", "1.5S", "123456789S", "10x", "-5S"])
def test_a_malformed_grpc_timeout_bounds_nothing(rig: Rig, value: str) -> None:
    """As a gRPC server ignores it: no deadline, none sent upstream."""
    raw = grpcclient.raw_call(rig.port, UNARY, headers=[("grpc-timeout", value)])
    assert raw.status == "0"
    assert rig.peer.calls[0].time_remaining is None


def test_a_grpc_timeout_in_each_unit_bounds_the_upstreams(rig: Rig) -> None:
    for value, most in (("1H", 60), ("2M", 60), ("3S", 3), ("2500m", 2.5), ("2000000u", 2)):
        rig.peer.reset()
        raw = grpcclient.raw_call(rig.port, UNARY, headers=[("grpc-timeout", value)])
        assert raw.status == "0"
        left = rig.peer.calls[0].time_remaining
        assert left is not None and 0 < left <= most, (value, left)


# -- 4. pushback ---------------------------------------------------------------------------------


def pushback(ms: str) -> list[Step]:
    return fail(UNAVAILABLE, trailers=(("grpc-retry-pushback-ms", ms),))


def test_a_pushback_within_the_deadline_is_waited_then_retried(rig: Rig) -> None:
    rig.peer.plan(pushback("200"), method=UNARY)
    answer = rig.call(UNARY, route="short", timeout=None)
    assert answer.code == OK
    assert len(rig.peer.calls) == 2


def test_a_pushback_past_the_deadline_stops_at_once(rig: Rig) -> None:
    rig.peer.plan(pushback("5000"), method=UNARY)
    answer = rig.call(UNARY, route="short", timeout=None)
    assert (answer.code, answer.details) == (UNAVAILABLE, "scripted unavailable")
    assert initial(answer, "x-retry-fate") == "retry-after-too-long"
    assert len(rig.peer.calls) == 1


@pytest.mark.parametrize("value", ["-1", "abc", "", "1.5"])
def test_a_negative_or_malformed_pushback_means_no_retry(rig: Rig, value: str) -> None:
    rig.peer.plan(pushback(value), method=UNARY)
    answer = rig.call(UNARY)
    assert answer.code == UNAVAILABLE
    assert len(rig.peer.calls) == 1


# -- 9. many calls at once -----------------------------------------------------------------------


# A connection of its own (grpcio shares one per target between channels otherwise): the
# sidecar allows 100 streams on a connection, and a stream another test reset counts until its
# request has unwound.
OWN_CONNECTION = [*grpcclient.OPTIONS, ("grpc.use_local_subchannel_pool", 1)]


def test_a_hundred_concurrent_unary_calls_on_one_channel_all_succeed(rig: Rig) -> None:
    with grpc.insecure_channel(rig.target, options=OWN_CONNECTION) as channel:
        unary = channel.unary_unary(UNARY)
        calls = [unary.future(b"m%d" % i, timeout=30) for i in range(100)]
        assert [c.result(timeout=45) for c in calls] == [b"m%d" % i for i in range(100)]
    assert len(rig.peer.calls) == 100


def test_a_hundred_concurrent_calls_each_retried_once_all_succeed(rig: Rig) -> None:
    rig.peer.plan(fail(UNAVAILABLE, 100), method=UNARY)
    with grpc.insecure_channel(rig.target, options=OWN_CONNECTION) as channel:
        unary = channel.unary_unary(UNARY)
        calls = [unary.future(b"m%d" % i, timeout=30) for i in range(100)]
        assert [c.result(timeout=45) for c in calls] == [b"m%d" % i for i in range(100)]
    assert len(rig.peer.calls) == 200


def test_a_large_message_each_way_passes_the_flow_control_windows(rig: Rig) -> None:
    """1 MiB request (over the retry buffer: streamed once) and its 1 MiB echo (over the
    upstream stream's window), then a server stream of large messages."""
    big = bytes(range(256)) * 4096
    answer = rig.call(UNARY, (big,))
    assert answer.code == OK and answer.messages == (big,)
    answer = rig.call(SERVER_STREAM, (big[: 300 * 1024],))
    assert answer.code == OK and [len(m) for m in answer.messages] == [300 * 1024 + 2] * 3

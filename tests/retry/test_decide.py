"""The decide step, with a fake clock and a fixed RNG: no sleeping, no I/O."""

from datetime import UTC, datetime
from email.utils import format_datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.model import Backoff, RetryAfter, RetryOn, RetryPolicy
from sidecar.core import Fate
from sidecar.outcomes import OutcomeKind
from sidecar.retry.classify import Outcome, may_resend
from sidecar.retry.deadline import Deadline, parse_timeout_ms
from sidecar.retry.decide import Constraints, Retry, Stop, decide
from sidecar.testing import FakeClock, FixedRng

POLICY = RetryPolicy(attempts=3, backoff=Backoff("exponential", base=0.1, max=1.0))
CLOCK = FakeClock()
NOW = CLOCK.monotonic()
WALL = CLOCK.wall()
LONG = Deadline(NOW + 60)


def resp(status: int, retry_after: str | None = None) -> Outcome:
    return Outcome(OutcomeKind.RESPONSE, status=status, retry_after=retry_after)


CONNECT = Outcome(OutcomeKind.CONNECT_FAILURE)
RESET = Outcome(OutcomeKind.RESET)
TIMEOUT = Outcome(OutcomeKind.PER_TRY_TIMEOUT)


NO_LIMITS = Constraints()


def run(outcome, attempt=1, policy=POLICY, deadline=LONG, c=NO_LIMITS, rng=0.5, prev=None):
    return decide(
        policy,
        outcome,
        attempt,
        prev,
        deadline,
        NOW,
        now_wall=WALL,
        rng=FixedRng(rng),
        constraints=c,
    )


def test_success_returns_at_once():
    assert run(resp(200)) == Stop(Fate.SUCCESS)
    assert run(resp(302)) == Stop(Fate.SUCCESS)


def test_status_not_in_retry_on_is_not_retryable():
    assert run(resp(500)) == Stop(Fate.NOT_RETRYABLE)
    assert run(resp(404)) == Stop(Fate.NOT_RETRYABLE)
    assert run(resp(429)) == Stop(Fate.NOT_RETRYABLE)


@pytest.mark.parametrize("outcome", [resp(502), resp(503), resp(504), CONNECT, RESET, TIMEOUT])
def test_retryable_outcomes_retry_with_backoff(outcome):
    first, second = run(outcome, attempt=1), run(outcome, attempt=2)
    assert isinstance(first, Retry) and first.delay == pytest.approx(0.1)
    assert isinstance(second, Retry) and second.delay == pytest.approx(0.2)


def test_conditions_are_per_policy():
    only_503 = RetryPolicy(retry_on=RetryOn(kinds=frozenset(), statuses=frozenset({503})))
    assert run(CONNECT, policy=only_503) == Stop(Fate.NOT_RETRYABLE)
    assert run(RESET, policy=only_503) == Stop(Fate.NOT_RETRYABLE)
    assert run(TIMEOUT, policy=only_503) == Stop(Fate.NOT_RETRYABLE)
    assert isinstance(run(resp(503), policy=only_503), Retry)


def test_last_attempt_is_exhausted_and_never_sleeps():
    assert run(resp(503), attempt=3) == Stop(Fate.EXHAUSTED)
    assert run(resp(503), attempt=99) == Stop(Fate.EXHAUSTED)


def test_non_idempotent_stops_unless_nothing_was_sent():
    c = Constraints(may_resend=False)
    assert run(resp(503), c=c) == Stop(Fate.NON_IDEMPOTENT)
    assert run(RESET, c=c) == Stop(Fate.NON_IDEMPOTENT)
    assert run(TIMEOUT, c=c) == Stop(Fate.NON_IDEMPOTENT)
    assert isinstance(run(CONNECT, c=c), Retry)


def test_unbuffered_body_is_never_resent():
    c = Constraints(body_replayable=False)
    assert run(resp(503), c=c) == Stop(Fate.BODY_TOO_LARGE)
    assert isinstance(run(CONNECT, c=c), Retry)


def test_edge_owned_allows_only_connect_failure():
    c = Constraints(edge_owned=True)
    assert run(resp(503), c=c) == Stop(Fate.EDGE_OWNED)
    assert run(RESET, c=c) == Stop(Fate.EDGE_OWNED)
    assert isinstance(run(CONNECT, c=c), Retry)
    assert run(resp(200), c=c) == Stop(Fate.SUCCESS)


def test_kill_switch_denies_a_wanted_retry():
    c = Constraints(killed=True)
    assert run(resp(503), c=c) == Stop(Fate.KILL_SWITCH)
    assert run(CONNECT, c=c) == Stop(Fate.KILL_SWITCH)
    assert run(resp(200), c=c) == Stop(Fate.SUCCESS)


def test_backoff_past_the_deadline_stops_now():
    short = Deadline(NOW + 0.05)
    assert run(resp(503), deadline=short) == Stop(Fate.DEADLINE)


def test_expired_deadline_on_a_failure_is_deadline():
    expired = Deadline(NOW)
    assert run(TIMEOUT, deadline=expired) == Stop(Fate.DEADLINE)
    assert run(resp(503), deadline=expired) == Stop(Fate.DEADLINE)
    # A good answer that arrives just in time is still a success.
    assert run(resp(200), deadline=expired) == Stop(Fate.SUCCESS)


def test_retry_after_seconds_is_honoured_and_jittered_upward():
    p = RetryPolicy(retry_on=RetryOn(statuses=frozenset({429, 503})))
    assert run(resp(429, "2"), policy=p, rng=0.0) == Retry(2.0, from_retry_after=True)
    hi = run(resp(503, "2"), policy=p, rng=1.0)
    assert isinstance(hi, Retry) and hi.delay == pytest.approx(2.2)


def test_retry_after_http_date():
    p = RetryPolicy(retry_on=RetryOn(statuses=frozenset({503})))
    date = format_datetime(datetime.fromtimestamp(WALL + 4, UTC), usegmt=True)
    d = run(resp(503, date), policy=p, rng=0.0)
    assert isinstance(d, Retry) and d.delay == pytest.approx(4.0) and d.from_retry_after


def test_retry_after_is_capped_by_max():
    p = RetryPolicy(retry_after=RetryAfter(True, max=1.5))
    assert run(resp(503, "3600"), policy=p, rng=0.0) == Retry(1.5, from_retry_after=True)


def test_retry_after_past_the_deadline_stops_with_its_own_fate():
    assert run(resp(503, "20"), deadline=Deadline(NOW + 5)) == Stop(Fate.RETRY_AFTER_TOO_LONG)


def test_retry_after_ignored_when_not_honoured_or_garbage():
    p = RetryPolicy(
        retry_after=RetryAfter(False, 30.0), backoff=Backoff("constant", base=0.01, max=0.01)
    )
    assert run(resp(503, "20"), policy=p) == Retry(0.01)
    assert run(resp(503, "soon"), policy=RetryPolicy(backoff=p.backoff)) == Retry(0.01)


def test_retry_after_only_on_429_and_503():
    p = RetryPolicy(backoff=Backoff("constant", base=0.01, max=0.01))
    assert run(resp(502, "20"), policy=p) == Retry(0.01)


@given(
    outcome=st.sampled_from([resp(503), resp(503, "1"), resp(429, "3"), CONNECT, RESET, TIMEOUT]),
    attempt=st.integers(1, 10),
    remaining=st.floats(0.0, 30.0),
    frac=st.floats(0.0, 1.0),
)
def test_never_sleeps_past_the_deadline(outcome, attempt, remaining, frac):
    p = RetryPolicy(attempts=10, retry_on=RetryOn(statuses=frozenset({429, 503})))
    d = run(outcome, attempt=attempt, policy=p, deadline=Deadline(NOW + remaining), rng=frac)
    if isinstance(d, Retry):
        assert 0.0 <= d.delay < remaining


def test_idempotency_rules():
    p = RetryPolicy(non_idempotent="with-idempotency-key")
    for m in ("GET", "HEAD", "OPTIONS", "PUT", "DELETE"):
        assert may_resend(p, m, False)
    assert not may_resend(p, "POST", False)
    assert may_resend(p, "POST", True)
    assert not may_resend(p, "PATCH", False)
    assert not may_resend(RetryPolicy(non_idempotent="never"), "POST", True)
    assert may_resend(RetryPolicy(non_idempotent="always"), "PATCH", False)


def test_deadline_takes_the_smaller_of_route_and_propagated():
    assert Deadline.start(100.0, 10.0, None).at == 110.0
    assert Deadline.start(100.0, 10.0, 2500).at == 102.5
    assert Deadline.start(100.0, 1.0, 2500).at == 101.0
    assert parse_timeout_ms("1500") == 1500
    for bad in (None, "", "-1", "1.5", "abc", "9" * 40, ",", "abc, -1"):
        assert parse_timeout_ms(bad) is None
    # Repeated lines, joined: the smallest well-formed value is the bound.
    assert parse_timeout_ms("1500, 800") == 800
    assert parse_timeout_ms("abc,1200 , 900") == 900
    assert parse_timeout_ms("99999999999,5") == 5

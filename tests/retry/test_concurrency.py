"""The adaptive concurrency limit, driven by simulated upstreams on a fake clock."""

from __future__ import annotations

import heapq
import random

from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.model import BulkheadPolicy
from sidecar.retry.concurrency import (
    INITIAL_LIMIT,
    MIN_RTT_WINDOW,
    PROBE_SAMPLES,
    AdaptiveLimit,
    Ticket,
)

POLICY = BulkheadPolicy(max_concurrent=1000, min_concurrent=5, adaptive=True)


class QueueingUpstream:
    """``workers`` requests at once, ``service`` seconds each, the rest queue first in first
    out: latency grows with concurrency (an overloaded application server)."""

    def __init__(self, workers: int, service: float) -> None:
        self.workers = workers
        self.service = service
        self.free_at = [0.0] * workers  # when each worker is next free

    def finish_time(self, now: float) -> float:
        i = min(range(self.workers), key=lambda k: self.free_at[k])
        start = max(now, self.free_at[i])
        self.free_at[i] = start + self.service
        return start + self.service


def drive(lim: AdaptiveLimit, rate: float, seconds: float, latency_of) -> dict[str, float]:
    """Open-loop arrivals at ``rate``; returns counts and the worst latency admitted late."""
    pending: list[tuple[float, int, object, float]] = []
    refused = admitted = 0
    late_latencies: list[float] = []
    n = int(rate * seconds)
    for i in range(n):
        now = i / rate
        while pending and pending[0][0] <= now:
            end, _, ticket, lat = heapq.heappop(pending)
            lim.release(end, ticket, lat)  # type: ignore[arg-type]
        ticket = lim.try_acquire(now)
        if ticket is None:
            refused += 1
            continue
        admitted += 1
        end = latency_of(now)
        if now > seconds / 2:
            late_latencies.append(end - now)
        heapq.heappush(pending, (end, i, ticket, end - now))
    while pending:  # the ones still running finish
        end, _, ticket, lat = heapq.heappop(pending)
        lim.release(end, ticket, lat)  # type: ignore[arg-type]
    return {
        "refused": refused,
        "admitted": admitted,
        "worst_late": max(late_latencies, default=0.0),
        "limit": lim.limit,
    }


def test_starts_at_its_initial_limit_and_refuses_over_it():
    lim = AdaptiveLimit(BulkheadPolicy(max_concurrent=1000, min_concurrent=5, adaptive=True))
    tickets = [lim.try_acquire(0.0) for _ in range(INITIAL_LIMIT)]
    assert all(t is not None for t in tickets)
    assert lim.try_acquire(0.0) is None and lim.refused == 1
    lim.release(0.1, tickets[0], None)  # type: ignore[arg-type]
    assert lim.try_acquire(0.1) is not None
    assert lim.in_flight == INITIAL_LIMIT


def test_disabled_never_refuses():
    lim = AdaptiveLimit(BulkheadPolicy(adaptive=False))
    assert all(lim.try_acquire(0.0) is not None for _ in range(5000))


def test_overload_is_held_at_the_upstreams_capacity():
    # 5 workers x 50 ms = 100 req/s offered 200 req/s: without a limit the queue (and the
    # latency) grows without end; with it, latency stays a small multiple of the service time
    # and the excess is refused at once.
    up = QueueingUpstream(workers=5, service=0.05)
    lim = AdaptiveLimit(POLICY)
    r = drive(lim, rate=200.0, seconds=30.0, latency_of=up.finish_time)
    assert r["worst_late"] < 0.5  # without the limit it would be ~15 s by now
    assert 5 <= r["limit"] <= 20
    # Goodput stays at capacity: about half of what was offered was admitted.
    assert 0.45 <= r["admitted"] / (200 * 30) <= 0.6


def test_an_upstream_within_capacity_is_never_refused():
    up = QueueingUpstream(workers=50, service=0.05)  # 1000 req/s of capacity
    lim = AdaptiveLimit(POLICY)
    r = drive(lim, rate=300.0, seconds=20.0, latency_of=up.finish_time)
    assert r["refused"] == 0


def test_slow_replies_that_are_not_queueing_are_never_refused():
    # 30% of replies take 3 s whatever the load (a slow dependency): ~90 in flight, not
    # overload -- the limit grows past it instead of refusing.
    rng = random.Random(5)
    lim = AdaptiveLimit(POLICY)
    r = drive(
        lim,
        rate=100.0,
        seconds=20.0,
        latency_of=lambda now: now + (3.0 if rng.random() < 0.3 else 0.001 + rng.random() / 500),
    )
    assert r["refused"] == 0
    assert r["limit"] >= 180


def test_low_use_leaves_the_limit_alone_whatever_the_latency():
    lim = AdaptiveLimit(POLICY)
    r = drive(lim, rate=10.0, seconds=30.0, latency_of=lambda now: now + 0.5 + (now % 1.0))
    assert r["limit"] == INITIAL_LIMIT and r["refused"] == 0


def test_a_binding_limit_without_calm_samples_measures_min_rtt_again():
    # An overload, and then, without a pause, the upstream gets 10x slower (a slower
    # dependency, not a queue): the limit binds and no attempt is ever calm, so min_rtt
    # would stay the old one forever. After MIN_RTT_WINDOW of refusing it is measured again
    # at the minimum limit, and the new no-load latency is adopted.
    lim = AdaptiveLimit(BulkheadPolicy(max_concurrent=1000, min_concurrent=5, adaptive=True))
    fast = QueueingUpstream(workers=5, service=0.05)
    slow = QueueingUpstream(workers=5, service=0.5)
    pending: list[tuple[float, int, object, float]] = []
    probed = False
    rate = 200.0
    for i in range(int(rate * (5 + MIN_RTT_WINDOW + 10))):
        now = i / rate
        while pending and pending[0][0] <= now:
            end, _, ticket, lat = heapq.heappop(pending)
            lim.release(end, ticket, lat)  # type: ignore[arg-type]
        m = lim.min_rtt()
        if now < 5.0:
            assert m is None or m < 0.2
        if lim._probe is not None:
            probed = True
            assert lim.limit == 5
        ticket = lim.try_acquire(now)
        if ticket is not None:
            end = (fast if now < 5.0 else slow).finish_time(now)
            heapq.heappush(pending, (end, i, ticket, end - now))
    assert probed
    after = lim.min_rtt()
    assert after is not None and after >= 0.4
    assert PROBE_SAMPLES > 0


@given(
    st.lists(
        st.tuples(st.booleans(), st.floats(min_value=0.0, max_value=0.05), st.floats(0.0001, 2.0)),
        max_size=400,
    ),
    st.integers(min_value=1, max_value=50),
    st.integers(min_value=1, max_value=200),
)
def test_in_flight_and_limit_stay_in_bounds(ops, lo, span):
    hi = lo + span
    lim = AdaptiveLimit(BulkheadPolicy(max_concurrent=hi, min_concurrent=lo, adaptive=True))
    held: list[Ticket] = []
    now = 0.0
    for acquire, gap, lat in ops:
        now += gap
        if acquire or not held:
            t = lim.try_acquire(now)
            if t is not None:
                held.append(t)
        else:
            lim.release(now, held.pop(0), lat)
        assert lim.in_flight == len(held) >= 0
        assert lo <= lim.limit <= hi
    for t in held:
        lim.release(now, t, None)
    assert lim.in_flight == 0

"""The latency window and the estimate behind ``per_try_timeout: auto``; fake clock only."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.retry.latency import (
    BUCKETS,
    GROWTH,
    HIGH,
    LOW,
    MIN_SAMPLES,
    AttemptLatency,
    LatencyWindow,
    bucket_of,
    quantile,
    upper_edge,
)


@given(st.floats(min_value=LOW, max_value=HIGH * 0.999))
def test_a_bucket_answers_within_5_percent_above(x):
    b = bucket_of(x)
    assert 0 <= b < BUCKETS
    assert x <= upper_edge(b) * (1 + 1e-9)
    assert upper_edge(b) <= x * GROWTH * (1 + 1e-9)


@given(st.lists(st.floats(min_value=0.0, max_value=1000.0), min_size=1, max_size=50))
def test_buckets_are_monotonic(xs):
    xs = sorted(xs)
    bs = [bucket_of(x) for x in xs]
    assert bs == sorted(bs)


def test_percentiles_of_a_known_mix():
    w = LatencyWindow(10.0)
    rng = random.Random(3)
    samples = [0.002 + rng.random() * 0.001 for _ in range(980)] + [1.0] * 20
    rng.shuffle(samples)
    for i, s in enumerate(samples):
        w.add(i / 1000, s)
    p50 = w.percentile(1.0, 0.5)
    p95 = w.percentile(1.0, 0.95)
    p99 = w.percentile(1.0, 0.99)
    assert p50 is not None and p95 is not None and p99 is not None
    assert quantile(samples, 0.5) <= p50 <= quantile(samples, 0.5) * GROWTH
    assert p95 <= 0.0031  # 2% slow replies do not reach the 95th percentile
    assert p99 == pytest.approx(1.0, rel=0.05)
    assert w.count(1.0) == 1000


def test_old_samples_leave_the_window():
    w = LatencyWindow(4.0)
    for _i in range(100):
        w.add(1.0, 5.0)
    assert w.percentile(1.5, 0.5) == pytest.approx(5.0, rel=0.05)
    for _i in range(100):
        w.add(6.0, 0.01)
    assert w.percentile(6.0, 0.99) == pytest.approx(0.01, rel=0.05)  # the 5 s ones are gone
    assert w.percentile(20.0, 0.5) is None


def test_too_few_samples_give_no_estimate():
    w = LatencyWindow(10.0)
    for _ in range(5):
        w.add(1.0, 0.1)
    assert w.percentile(1.0, 0.5, min_samples=6) is None
    assert w.percentile(1.0, 0.5, min_samples=5) is not None


def test_auto_timeout_is_a_clamped_multiple_and_cold_start_uses_the_maximum():
    est = AttemptLatency(span=10.0, refresh=0.1)
    assert est.timeout(0.0, 0.95, 2.0, 0.05, 10.0) == 10.0  # nothing seen yet
    for _i in range(MIN_SAMPLES):
        est.observe(1.0, 0.2)
    # Cached for ``refresh``: the cold answer stands a little longer.
    assert est.timeout(0.05, 0.95, 2.0, 0.05, 10.0) == 10.0
    assert est.timeout(1.0, 0.95, 2.0, 0.05, 10.0) == pytest.approx(0.4, rel=0.05)
    assert est.timeout(1.0, 0.95, 2.0, 0.5, 10.0) == 0.5  # clamped up
    assert est.timeout(1.0, 0.95, 100.0, 0.05, 10.0) == 10.0  # clamped down


def test_fast_replies_give_the_minimum():
    est = AttemptLatency()
    for i in range(200):
        est.observe(i / 100, 0.001)
    assert est.timeout(2.0, 0.95, 2.0, 0.05, 10.0) == 0.05


def test_a_cancelled_attempt_counts_as_at_least_its_time_once_past_the_timeout():
    """A censored sample (it took at least this long): a hedged original that lost ran past
    the timeout and belongs to the tail; a hedge cancelled a moment after it started does not
    say how long it would have taken and is left out."""
    est = AttemptLatency(span=10.0)
    for _ in range(19):
        est.observe(1.0, 0.005)
    est.observe_censored(1.0, 0.06, timeout=0.05)  # ran past the 50 ms timeout, then lost
    est.observe_censored(1.0, 0.01, timeout=0.05)  # a hedge that lost to its original
    assert est.window.count(1.0) == 20
    assert est.window.percentile(1.0, 0.99) == pytest.approx(0.06, rel=0.05)

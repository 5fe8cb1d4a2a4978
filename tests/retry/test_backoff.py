import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.config.model import Backoff
from sidecar.retry.backoff import delay, exponential_ceiling
from sidecar.testing import FixedRng

STRATEGIES = ["full_jitter", "equal_jitter", "decorrelated_jitter", "exponential", "constant"]


def test_exponential_doubles_then_caps():
    p = Backoff("exponential", base=0.025, max=0.25)
    got = [delay(p, n, None, FixedRng(0.5)) for n in range(1, 7)]
    assert got == pytest.approx([0.025, 0.05, 0.1, 0.2, 0.25, 0.25])


def test_full_jitter_spans_zero_to_ceiling():
    p = Backoff("full_jitter", base=0.1, max=10.0)
    assert delay(p, 3, None, FixedRng(0.0)) == 0.0
    assert delay(p, 3, None, FixedRng(1.0)) == pytest.approx(0.4)


def test_equal_jitter_keeps_half():
    p = Backoff("equal_jitter", base=0.1, max=10.0)
    assert delay(p, 3, None, FixedRng(0.0)) == pytest.approx(0.2)
    assert delay(p, 3, None, FixedRng(1.0)) == pytest.approx(0.4)


def test_decorrelated_jitter_grows_from_previous():
    p = Backoff("decorrelated_jitter", base=0.1, max=10.0)
    assert delay(p, 1, None, FixedRng(1.0)) == pytest.approx(0.3)
    assert delay(p, 2, 0.3, FixedRng(1.0)) == pytest.approx(0.9)
    assert delay(p, 2, 0.3, FixedRng(0.0)) == pytest.approx(0.1)
    assert delay(p, 9, 9.0, FixedRng(1.0)) == pytest.approx(10.0)


def test_constant_is_base():
    p = Backoff("constant", base=0.07, max=1.0)
    assert [delay(p, n, None, FixedRng(0.9)) for n in (1, 5, 50)] == [0.07] * 3


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_huge_attempt_numbers_do_not_overflow(strategy):
    p = Backoff(strategy, base=0.025, max=0.25)  # type: ignore[arg-type]
    for n in (64, 1025, 10**6, 10**18):
        d = delay(p, n, 0.25, random.Random(1))
        assert 0.0 <= d <= 0.25
    assert exponential_ceiling(p, 10**18) == 0.25


@given(
    strategy=st.sampled_from(STRATEGIES),
    base=st.floats(min_value=0.0, max_value=60.0),
    extra=st.floats(min_value=0.0, max_value=600.0),
    n=st.integers(min_value=1, max_value=10**9),
    previous=st.one_of(st.none(), st.floats(min_value=0.0, max_value=1e6)),
    seed=st.integers(0, 2**32),
)
def test_delay_always_within_zero_and_cap(strategy, base, extra, n, previous, seed):
    p = Backoff(strategy, base=base, max=base + extra)
    d = delay(p, n, previous, random.Random(seed))
    assert 0.0 <= d <= p.max

"""Backoff delays: pure functions of (policy, retry number, previous delay, rng).

Strategies follow the AWS Architecture Blog "Exponential Backoff and Jitter". Every result lies in
[0, policy.max] for any retry number: the exponent is clamped before it is computed, so attempt
10**9 neither overflows a float nor raises.
"""

from __future__ import annotations

from typing import Protocol

from sidecar.config.model import Backoff


class Rng(Protocol):
    def uniform(self, a: float, b: float) -> float: ...


def exponential_ceiling(policy: Backoff, retry_number: int) -> float:
    """base * 2**(retry_number-1), capped at max; retry_number is 1 for the first retry."""
    if policy.base <= 0:
        return 0.0
    n = max(0, retry_number - 1)
    if policy.max <= policy.base:
        return policy.max
    # 2.0**n overflows past 1023: clamp the exponent first. A product that overflows to inf
    # (huge base times 2**1023) is harmless: min() brings it back to max.
    if n > 1023:
        return policy.max
    return min(policy.max, policy.base * (2.0**n))


def delay(policy: Backoff, retry_number: int, previous: float | None, rng: Rng) -> float:
    """The sleep before retry number ``retry_number`` (1-based)."""
    ceiling = exponential_ceiling(policy, retry_number)
    strategy = policy.strategy
    if strategy == "exponential":
        d = ceiling
    elif strategy == "full_jitter":
        d = rng.uniform(0.0, ceiling)
    elif strategy == "equal_jitter":
        half = ceiling / 2.0
        d = half + rng.uniform(0.0, half)
    elif strategy == "decorrelated_jitter":
        prev = policy.base if previous is None else previous
        upper = min(policy.max, max(policy.base, prev * 3.0))
        d = rng.uniform(policy.base, upper) if upper > policy.base else policy.base
    elif strategy == "constant":
        d = policy.base
    else:  # pragma: no cover - the parser admits only the names above
        raise ValueError(f"unknown backoff strategy {strategy!r}")
    return min(max(d, 0.0), policy.max)

"""Recent attempt latency of one route, and percentiles of it. Pure, clock injected.

Samples go into log-spaced buckets (about 5% apart, from 100 microseconds to 5 minutes), held
in ``SLICES`` rotating sub-windows that together span ``span`` seconds: memory is constant
whatever the traffic, a percentile costs one pass over the buckets, and old samples fall out as
the window moves. A percentile answers with its bucket's upper edge, so it errs on the long
side by at most one bucket (5%).
"""

from __future__ import annotations

import math

LOW = 1e-4  # seconds: the first bucket holds everything up to this
HIGH = 300.0  # the last bucket holds everything beyond
GROWTH = 1.05
BUCKETS = math.ceil(math.log(HIGH / LOW) / math.log(GROWTH)) + 2
_LOG_GROWTH = math.log(GROWTH)
SLICES = 4


def bucket_of(seconds: float) -> int:
    if seconds <= LOW:
        return 0
    if seconds >= HIGH:
        return BUCKETS - 1
    return min(BUCKETS - 2, 1 + int(math.log(seconds / LOW) / _LOG_GROWTH))


def upper_edge(bucket: int) -> float:
    """The largest latency bucket ``bucket`` holds (its percentile answer)."""
    if bucket <= 0:
        return LOW
    if bucket >= BUCKETS - 1:
        return HIGH
    return float(LOW * GROWTH**bucket)


class LatencyWindow:
    __slots__ = ("_counts", "_epoch", "_n", "_width", "span")

    def __init__(self, span: float) -> None:
        self.span = span
        self._width = span / SLICES
        self._counts = [[0] * BUCKETS for _ in range(SLICES)]
        self._n = [0] * SLICES
        self._epoch = [-1] * SLICES

    def _live(self, now: float) -> list[int]:
        n = int(now / self._width)
        return [i for i in range(SLICES) if n - SLICES < self._epoch[i] <= n]

    def add(self, now: float, seconds: float) -> None:
        n = int(now / self._width)
        i = n % SLICES
        if self._epoch[i] != n:
            self._epoch[i] = n
            self._counts[i] = [0] * BUCKETS
            self._n[i] = 0
        self._counts[i][bucket_of(max(0.0, seconds))] += 1
        self._n[i] += 1

    def count(self, now: float) -> int:
        return sum(self._n[i] for i in self._live(now))

    def percentile(self, now: float, q: float, min_samples: int = 1) -> float | None:
        """The ``q`` quantile (0 < q < 1) of the samples in the window, or None with fewer
        than ``min_samples`` of them."""
        live = self._live(now)
        total = sum(self._n[i] for i in live)
        if total < max(1, min_samples):
            return None
        rank = q * total
        seen = 0
        for b, c in enumerate(map(sum, zip(*(self._counts[i] for i in live), strict=True))):
            seen += c
            if seen >= rank and seen > 0:
                return upper_edge(b)
        return HIGH  # pragma: no cover - the loop always reaches the total


MIN_SAMPLES = 20  # fewer than this in the window: no estimate, ``auto`` uses its maximum


class AttemptLatency:
    """The per-route estimator behind ``per_try_timeout: auto``: multiplier x percentile of the
    attempt latencies of the last ``span`` seconds, clamped to [min, max]; recomputed at most
    every ``refresh`` seconds (a percentile costs a pass over the buckets)."""

    __slots__ = ("_at", "_key", "_value", "refresh", "slow_at", "window")

    def __init__(self, span: float = 10.0, refresh: float = 0.1) -> None:
        self.window = LatencyWindow(span)
        self.refresh = refresh
        self._at = -math.inf
        self._key: tuple[float, float, float, float] | None = None
        self._value = 0.0
        self.slow_at = -math.inf  # when an attempt last ran past the per-try timeout

    def observe(self, now: float, seconds: float) -> None:
        self.window.add(now, seconds)

    def observe_censored(self, now: float, at_least: float, timeout: float) -> None:
        """A cancelled attempt (a hedged original that lost, one the deadline or the client
        ended): it took at least ``at_least`` seconds -- a censored sample. Counted as that
        long when it ran at least the per-try timeout in force (``timeout``): then it lies in
        the tail the timeout is estimated from, and leaving it out (learning only from
        winners) would keep the estimate low and hedge for ever what a fresh estimate would
        not. A shorter one (a hedge that lost to its original a moment after it started) says
        nothing of its latency and would pull the estimate down: left out."""
        if at_least >= timeout:
            self.window.add(now, at_least)

    def ran_long(self, now: float) -> None:
        """An attempt ran past the per-try timeout in force (answered late, or was still
        running when it was cancelled)."""
        self.slow_at = now

    def tail_seen(self, now: float) -> bool:
        """Has an attempt of this route run past the per-try timeout within the window? Only
        then is a request prepared for hedging (its attempts run as tasks, which costs every
        request a little): an upstream with no tail is never hedged anyway."""
        return now - self.slow_at <= self.window.span

    def timeout(
        self, now: float, percentile: float, multiplier: float, lo: float, hi: float
    ) -> float:
        key = (percentile, multiplier, lo, hi)
        if key == self._key and now - self._at < self.refresh:
            return self._value
        p = self.window.percentile(now, percentile, MIN_SAMPLES)
        value = hi if p is None else min(hi, max(lo, multiplier * p))
        self._key, self._at, self._value = key, now, value
        return value


def quantile(samples: list[float], q: float) -> float:
    """The ``q`` quantile of a small list (nearest rank). ``samples`` must not be empty."""
    ordered = sorted(samples)
    k = min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))
    return ordered[k]

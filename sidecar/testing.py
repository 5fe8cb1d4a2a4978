"""Helpers for tests: a fake clock and a scripted RNG. No I/O, no sleeping."""

from __future__ import annotations

from sidecar.core import Clock


class FakeClock(Clock):
    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0) -> None:
        self._mono = monotonic
        self._wall = wall

    def monotonic(self) -> float:
        return self._mono

    def wall(self) -> float:
        return self._wall

    def advance(self, seconds: float) -> None:
        self._mono += seconds
        self._wall += seconds

    def step_wall(self, seconds: float) -> None:
        """A host clock correction: the wall clock jumps, the monotonic clock does not."""
        self._wall += seconds


class FixedRng:
    """uniform(a, b) returns a + fraction * (b - a): 0.0 gives the low end, 1.0 the high end."""

    def __init__(self, fraction: float) -> None:
        self.fraction = fraction

    def uniform(self, a: float, b: float) -> float:
        return a + self.fraction * (b - a)

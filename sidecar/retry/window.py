"""A sliding window of counters in fixed buckets (clock injected, no allocation per event)."""

from __future__ import annotations

BUCKETS = 10


class Window:
    """Counts two numbers (``a`` and ``b``) over the last ``span`` seconds in BUCKETS buckets.

    Memory is constant whatever the request rate, unlike a list of timestamps.
    """

    __slots__ = ("_a", "_b", "_epoch", "_width", "span")

    def __init__(self, span: float) -> None:
        self.span = span
        self._width = span / BUCKETS
        self._a = [0] * BUCKETS
        self._b = [0] * BUCKETS
        self._epoch = [-1] * BUCKETS  # which bucket number each slot currently holds

    def _slot(self, now: float) -> int:
        n = int(now / self._width)
        i = n % BUCKETS
        if self._epoch[i] != n:
            self._epoch[i] = n
            self._a[i] = 0
            self._b[i] = 0
        return i

    def add(self, now: float, a: int = 0, b: int = 0) -> None:
        i = self._slot(now)
        self._a[i] += a
        self._b[i] += b

    def take_back(self, at: float, a: int = 0, b: int = 0) -> None:
        """Undo an ``add(at, a, b)``, if its bucket is still in the window (else it has left
        the window already)."""
        n = int(at / self._width)
        i = n % BUCKETS
        if self._epoch[i] == n:
            self._a[i] = max(0, self._a[i] - a)
            self._b[i] = max(0, self._b[i] - b)

    def totals(self, now: float) -> tuple[int, int]:
        n = int(now / self._width)
        ta = tb = 0
        for i in range(BUCKETS):
            if n - BUCKETS < self._epoch[i] <= n:
                ta += self._a[i]
                tb += self._b[i]
        return ta, tb

    def clear(self) -> None:
        self._a = [0] * BUCKETS
        self._b = [0] * BUCKETS
        self._epoch = [-1] * BUCKETS

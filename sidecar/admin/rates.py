"""Recent rates for the status page, from the metrics counters, as Prometheus' ``rate()`` does.

The hot path pays nothing for this: a background task copies the few per-route counters
(requests by fate, retries) every ``interval`` seconds into a bounded history, and a window is
the live counters minus the sample taken at the window's start. Clock injected.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from sidecar.core import Clock
from sidecar.telemetry.metrics import Metrics

INTERVAL = 2.0
KEEP = 5 * 60.0  # the longest window offered


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # monotonic
    fates: dict[str, dict[str, float]]  # route -> fate -> sequences so far
    retries: dict[str, float]  # route -> retries so far


@dataclass(frozen=True, slots=True)
class RouteWindow:
    """What one route did in the window."""

    requests: int
    retries: int
    fates: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Windowed:
    seconds: float  # the span actually covered (shorter than asked right after start)
    routes: dict[str, RouteWindow]


def sample(metrics: Metrics, at: float) -> Sample:
    fates: dict[str, dict[str, float]] = {}
    for labels, v in metrics.requests.values.items():
        d = dict(labels)
        fates.setdefault(d["route"], {})[d["fate"]] = v
    retries = {dict(labels)["route"]: v for labels, v in metrics.retries.values.items()}
    return Sample(at, fates, retries)


def difference(now: Sample, then: Sample) -> Windowed:
    routes: dict[str, RouteWindow] = {}
    for route, fates in now.fates.items():
        before = then.fates.get(route, {})
        delta = {f: round(v - before.get(f, 0.0)) for f, v in fates.items()}
        delta = {f: n for f, n in delta.items() if n > 0}
        retries = round(now.retries.get(route, 0.0) - then.retries.get(route, 0.0))
        routes[route] = RouteWindow(sum(delta.values()), max(0, retries), delta)
    return Windowed(max(0.0, now.at - then.at), routes)


class RateSampler:
    def __init__(
        self, metrics: Metrics, clock: Clock, interval: float = INTERVAL, keep: float = KEEP
    ) -> None:
        self.metrics = metrics
        self.clock = clock
        self.interval = interval
        self._history: deque[Sample] = deque(maxlen=int(keep / interval) + 2)
        self.tick()  # a window right after start covers the time since start

    def tick(self) -> None:
        self._history.append(sample(self.metrics, self.clock.monotonic()))

    def window(self, seconds: float) -> Windowed:
        """The last ``seconds`` (or as much of them as the history holds)."""
        now = sample(self.metrics, self.clock.monotonic())
        start = now.at - seconds
        base = self._history[0]
        for s in self._history:  # the newest sample at or before the window's start
            if s.at <= start:
                base = s
            else:
                break
        return difference(now, base)

    async def run(self) -> None:
        """Until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            self.tick()

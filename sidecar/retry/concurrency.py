"""The adaptive concurrency limit of one route: a gradient limit, clock injected, no I/O.

Upstream attempts in flight are held below a limit that follows latency, in the manner of
Envoy's adaptive-concurrency filter and Netflix's Gradient2Limit. Every ``INTERVAL`` (once at
least ``MIN_SAMPLES`` attempts have ended) the limit moves by the gradient

    gradient  = clamp((min_rtt * TOLERANCE + SLACK) / sample_rtt, 0.5, 2.0)
    new_limit = limit * gradient + sqrt(limit * gradient)      (the square root is headroom)

where ``sample_rtt`` is the median attempt latency of the interval and ``min_rtt`` the latency
without queueing. ``TOLERANCE`` (Gradient2's rttTolerance; Envoy's 25% buffer) and an absolute
``SLACK`` keep scheduling noise from counting as queueing: a 1 ms upstream answering in 2 ms on
a busy host is not overloaded, and a pure ratio would halve the limit for it. When latency is
near ``min_rtt`` the limit grows; when requests queue in the upstream, latency rises with
concurrency and the limit falls until the queue is gone. An attempt over the limit is refused
at once (no waiting): the upstream was not asked.

Three choices keep it from hurting traffic that is not overload:

- It does not move while the route is using less than half of it (Netflix's "app limited"
  rule): latency noise at low concurrency never shrinks it, and it never grows without use.
- ``min_rtt`` is the smallest interval median of *calm* attempts over ``MIN_RTT_WINDOW``
  (attempts that started with fewer than half the limit in flight). Under overload there are no
  calm attempts, so the estimate keeps its last value instead of drifting up with the queue
  (Gradient2's long-term average drifts; Envoy re-measures).
- When the limit has been refusing attempts for a whole ``MIN_RTT_WINDOW`` without one calm
  sample, ``min_rtt`` is measured again: the limit is held at its minimum for ``PROBE_SAMPLES``
  attempts (as Envoy's periodic minRTT window does, but only when it binds). A latency
  regression that is not overload (a slower dependency) is adopted that way instead of keeping
  the limit at its floor.

Hedge and retry attempts count like first attempts; a hedge is only started when there is room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sidecar.config.model import BulkheadPolicy
from sidecar.retry.latency import quantile

INTERVAL = 0.1
MIN_SAMPLES = 10
TOLERANCE = 1.5
SLACK = 0.005
MIN_RTT_WINDOW = 10.0
MIN_RTT_SLICES = 5
PROBE_SAMPLES = 20
INITIAL_LIMIT = 100


@dataclass(slots=True, init=False)
class Ticket:
    """One attempt in flight, held by the attempt's scope and given back by ``release``."""

    start: float
    calm: bool

    # An explicit __init__: mypyc compiles it, where the one @dataclass generates stays
    # interpreted (~3,000 instructions per object made, against ~300). One is made per attempt.
    def __init__(self, start: float, calm: bool) -> None:
        self.start = start
        self.calm = calm


class _WindowedMin:
    """The minimum of values added over the last ``span`` seconds; the last known minimum
    when the window holds none."""

    __slots__ = ("_epoch", "_mins", "_width", "last")

    def __init__(self, span: float) -> None:
        self._width = span / MIN_RTT_SLICES
        self._mins = [math.inf] * MIN_RTT_SLICES
        self._epoch = [-1] * MIN_RTT_SLICES
        self.last: float | None = None

    def add(self, now: float, value: float) -> None:
        n = int(now / self._width)
        i = n % MIN_RTT_SLICES
        if self._epoch[i] != n:
            self._epoch[i] = n
            self._mins[i] = math.inf
        self._mins[i] = min(self._mins[i], value)

    def fresh(self, now: float) -> float | None:
        n = int(now / self._width)
        live = [
            self._mins[i] for i in range(MIN_RTT_SLICES) if n - MIN_RTT_SLICES < self._epoch[i] <= n
        ]
        best = min(live, default=math.inf)
        return None if best == math.inf else best

    def value(self, now: float) -> float | None:
        v = self.fresh(now)
        if v is not None:
            self.last = v
        return self.last

    def reset(self, value: float) -> None:
        self._mins = [math.inf] * MIN_RTT_SLICES
        self._epoch = [-1] * MIN_RTT_SLICES
        self.last = value


class AdaptiveLimit:
    def __init__(self, policy: BulkheadPolicy) -> None:
        self.policy = policy
        self.in_flight = 0
        self.limit = float(min(policy.max_concurrent, max(policy.min_concurrent, INITIAL_LIMIT)))
        self.refused = 0
        self._min_rtt = _WindowedMin(MIN_RTT_WINDOW)
        self._interval_start: float | None = None
        self._samples: list[float] = []
        self._calm: list[float] = []
        self._peak = 0
        self._refused_in_interval = 0
        self._binding_since: float | None = None  # refusing with no calm sample since then
        self._probe: list[float] | None = None  # samples of a min_rtt measurement under way
        self._probe_start = 0.0
        self._saved_limit = self.limit

    @property
    def enabled(self) -> bool:
        return self.policy.adaptive

    def update_policy(self, policy: BulkheadPolicy) -> None:
        self.policy = policy
        self.limit = min(
            float(policy.max_concurrent), max(float(policy.min_concurrent), self.limit)
        )

    def min_rtt(self) -> float | None:
        return self._min_rtt.last

    def try_acquire(self, now: float) -> Ticket | None:
        """A ticket for one more attempt, or None when the limit is reached."""
        if self.enabled and self.in_flight >= int(self.limit):
            self.refused += 1
            self._refused_in_interval += 1
            self._maybe_update(now)
            return None
        calm = self.in_flight < self.limit / 2 or self._probe is not None
        self.in_flight += 1
        if self.in_flight > self._peak:
            self._peak = self.in_flight
        return Ticket(now, calm)

    def release(self, now: float, ticket: Ticket, latency: float | None) -> None:
        """The attempt ended. ``latency``: seconds to its response head, the time it was
        abandoned after (a timeout: the latency is at least that), or None when it says
        nothing about latency (a connection failure, a hedge cancelled because another won)."""
        self.in_flight -= 1
        if latency is None:
            return
        if self._probe is not None:
            if ticket.start < self._probe_start:
                return  # admitted before the limit was lowered: it queued with the others
            self._probe.append(latency)
            if len(self._probe) >= PROBE_SAMPLES:
                self._min_rtt.reset(quantile(self._probe, 0.5))
                self._probe = None
                self._binding_since = None
                self.limit = self._saved_limit
            return
        self._samples.append(latency)
        if ticket.calm:
            self._calm.append(latency)
        self._maybe_update(now)

    def _maybe_update(self, now: float) -> None:
        if self._interval_start is None:
            self._interval_start = now
            return
        if now - self._interval_start < INTERVAL or len(self._samples) < MIN_SAMPLES:
            return
        if self._calm:
            self._min_rtt.add(now, quantile(self._calm, 0.5))
        sample = quantile(self._samples, 0.5)
        peak, refused, calm = self._peak, self._refused_in_interval, bool(self._calm)
        self._interval_start = now
        self._samples = []
        self._calm = []
        self._peak = self.in_flight
        self._refused_in_interval = 0
        if not self.enabled:
            return
        self._track_binding(now, refused > 0, calm)
        min_rtt = self._min_rtt.value(now)
        if min_rtt is None or peak < self.limit / 2:
            return  # no baseline yet, or app limited: latency says nothing about the limit
        gradient = min(2.0, max(0.5, (min_rtt * TOLERANCE + SLACK) / max(sample, 1e-6)))
        new = self.limit * gradient
        new += math.sqrt(new)
        self.limit = min(
            float(self.policy.max_concurrent), max(float(self.policy.min_concurrent), new)
        )

    def _track_binding(self, now: float, refused: bool, calm: bool) -> None:
        if calm or not refused:
            self._binding_since = None
            return
        if self._binding_since is None:
            self._binding_since = now
        elif now - self._binding_since >= MIN_RTT_WINDOW and self._probe is None:
            # Refusing for a whole window and never calm: measure the no-load latency again.
            self._saved_limit = self.limit
            self.limit = float(self.policy.min_concurrent)
            self._probe = []
            self._probe_start = now

"""Adaptive throttling of the attempts the sidecar adds (retries and hedges), clock injected.

The Google SRE book's client-side throttling ("Handling Overload"): over a sliding ``window``
the route counts the attempts it sent upstream (``requests``) and those the upstream accepted
(``accepts``: any answer that is not a retryable failure), and refuses an extra attempt locally
with probability

    max(0, (requests - k * accepts) / (requests + 1))

Healthy, nothing is refused; as the upstream's accept ratio falls below 1/k, a growing share of
retries and hedges is refused; when it accepts (almost) nothing -- ``DOWN_ACCEPT_RATIO`` -- every
one is: the formula's "+1" exists to keep probing, which first attempts do here anyway. Envoy's
admission-control filter computes the same thing.

Why only the *extra* attempts, never a client's first one: with a failure that does not depend
on load (a bad replica answering 60% of requests with 503), refusing first attempts locally
makes things worse than having no sidecar at all -- the upstream then sees fewer requests, so
fewer accepts, so the refusal probability climbs again: with k = 2 and a 40% accept ratio it
settles at refusing everything. First attempts are left to the breaker ("down") and to the
adaptive concurrency limit ("overloaded"); this throttle grades how much the sidecar adds on
top, which is the answer to "degraded". Below ``min_requests`` attempts in the window it
refuses nothing: a handful of samples is not a ratio, and the retry budget's floor governs.
"""

from __future__ import annotations

from typing import Protocol

from sidecar.config.model import ThrottlePolicy
from sidecar.retry.window import Window

# Below this share of its attempts accepted (with at least ``min_requests`` of them in the
# window), the route's upstream counts as down: a sequence that the throttle or the budget cut
# short is then evidence for the breaker after all (see ``classify.verdict``).
DOWN_ACCEPT_RATIO = 0.05


class Random01(Protocol):
    def random(self) -> float: ...


class Throttle:
    __slots__ = ("_window", "policy", "refused")

    def __init__(self, policy: ThrottlePolicy) -> None:
        self.policy = policy
        self._window = Window(policy.window)  # a = requests (attempts sent), b = accepts
        self.refused = 0

    def update_policy(self, policy: ThrottlePolicy) -> None:
        if policy.window != self.policy.window:
            self._window = Window(policy.window)
        self.policy = policy

    def record(self, now: float, accepted: bool) -> None:
        """One attempt that reached the upstream (or tried to) has ended; or, not accepted, one
        sequence the route's open breaker refused (``RouteState.admit``): as the SRE book
        counts the requests its throttle rejects, so that the window does not empty while the
        breaker is open and each half-open ramp starts knowing "down"."""
        self._window.add(now, a=1, b=1 if accepted else 0)

    def probability(self, now: float) -> float:
        """The probability that an extra attempt is refused now."""
        requests, accepts = self._window.totals(now)
        if requests < max(1, self.policy.min_requests):
            return 0.0
        if accepts <= DOWN_ACCEPT_RATIO * requests:
            # Down: the formula's "+1" keeps a trickle going so that a client notices the
            # recovery, but first attempts (never throttled) do that here; a retry into an
            # upstream that accepts nothing only adds load.
            return 1.0
        return max(0.0, (requests - self.policy.k * accepts) / (requests + 1))

    def allow(self, now: float, rng: Random01) -> bool:
        """May the sidecar add one more attempt (a retry or a hedge)?"""
        if not self.policy.enabled:
            return True
        p = self.probability(now)
        if p >= 1.0 or (p > 0.0 and rng.random() < p):
            self.refused += 1
            return False
        return True

    def down(self, now: float) -> bool:
        """Has the upstream accepted (almost) none of the route's recent attempts?"""
        requests, accepts = self._window.totals(now)
        return requests >= max(1, self.policy.min_requests) and accepts <= (
            DOWN_ACCEPT_RATIO * requests
        )

    def counts(self, now: float) -> tuple[int, int]:
        """(requests, accepts) in the current window."""
        return self._window.totals(now)

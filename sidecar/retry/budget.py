"""The retry budget of one route (Linkerd/Envoy style), clock injected.

Retries may add at most ``ratio`` of the route's recent request rate plus ``min_per_second``,
over ``window``: a retry is allowed while

    retries_in_window < ratio * requests_in_window + min_per_second * window
"""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from sidecar.config.model import BudgetPolicy
from sidecar.retry.window import Window


@mypyc_attr(allow_interpreted_subclasses=True)  # tests inject faults by subclassing
class Budget:
    def __init__(self, policy: BudgetPolicy) -> None:
        self.policy = policy
        self._window = Window(policy.window)  # a = requests, b = retries
        self.exhausted = 0

    def update_policy(self, policy: BudgetPolicy) -> None:
        if policy.window != self.policy.window:
            self._window = Window(policy.window)
        self.policy = policy

    def record_request(self, now: float) -> None:
        self._window.add(now, a=1)

    def try_retry(self, now: float) -> bool:
        requests, retries = self._window.totals(now)
        allowed = self.policy.ratio * requests + self.policy.min_per_second * self.policy.window
        if retries < allowed:
            self._window.add(now, b=1)
            return True
        self.exhausted += 1
        return False

    def counts(self, now: float) -> tuple[int, int]:
        """(requests, retries) in the current window."""
        return self._window.totals(now)

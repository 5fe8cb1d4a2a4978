"""The retry budget of one route (Linkerd/Envoy style), clock injected.

Retries may add at most ``ratio`` of the route's recent request rate plus ``min_per_second``,
over ``window``: a retry is allowed while

    retries_in_window < ratio * requests_in_window + min_per_second * window

A retry takes its token when it is decided (the answer it would replace is still in hand, so a
refusal can relay it) and gives it back if it is not sent after all (``give_back``): only the
retries the upstream really gets count.
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

    def give_back(self, spent_at: float) -> None:
        """A retry that ``try_retry`` allowed at ``spent_at`` was not sent after all (stopped
        during its backoff, or refused by the sidecar's own limits): it costs nothing."""
        self._window.take_back(spent_at, b=1)

    def counts(self, now: float) -> tuple[int, int]:
        """(requests, retries) in the current window."""
        return self._window.totals(now)

"""Classification of one attempt's outcome, and the idempotency rules. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config.model import RetryPolicy
from sidecar.core import LocalOverload, OutcomeKind, UpstreamError, Verdict


@dataclass(frozen=True, slots=True)
class Outcome:
    """What one attempt produced, in the project's own terms (no aiohttp types)."""

    kind: OutcomeKind
    status: int = 0
    retry_after: str | None = None  # the raw Retry-After header of a response
    detail: str = ""

    @property
    def label(self) -> str:
        """A bounded word for metrics and spans: a status code or the failure kind."""
        if self.kind is OutcomeKind.RESPONSE:
            return str(self.status)
        return str(self.kind.value)


IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})


def is_retryable(policy: RetryPolicy, outcome: Outcome) -> bool:
    on = policy.retry_on
    kind = outcome.kind
    if kind is OutcomeKind.RESPONSE:
        return outcome.status in on.statuses
    if kind is OutcomeKind.CONNECT_FAILURE:
        return on.connect_failure
    if kind is OutcomeKind.RESET:
        return on.reset
    if kind is OutcomeKind.BAD_RESPONSE:
        return False
    return on.per_try_timeout


def is_success(outcome: Outcome) -> bool:
    return outcome.kind is OutcomeKind.RESPONSE and outcome.status < 400


def may_resend(policy: RetryPolicy, method: str, has_idempotency_key: bool) -> bool:
    """Whether a request whose bytes may have reached the upstream can be sent again."""
    if method in IDEMPOTENT_METHODS:
        return True
    mode = policy.non_idempotent
    if mode == "always":
        return True
    if mode == "with-idempotency-key":
        return has_idempotency_key
    return False


def nothing_reached_upstream(outcome: Outcome) -> bool:
    """A connect failure: no byte of the request left this process, any method may be retried."""
    return outcome.kind is OutcomeKind.CONNECT_FAILURE


def sequence_failed(policy: RetryPolicy, final_status: int | None, errored: bool) -> bool:
    """The one breaker event of a sequence: failed when it ended on an upstream error, a 5xx,
    or a status the policy treats as retryable (429 when listed). 4xx answers are the
    upstream working as intended."""
    if errored or final_status is None:
        return True
    return final_status >= 500 or final_status in policy.retry_on.statuses


def verdict(
    policy: RetryPolicy,
    final_status: int | None,
    error: UpstreamError | LocalOverload | None,
    failed_before: bool = False,
) -> Verdict:
    """What a finished sequence tells its breaker (one verdict per sequence).

    Neutral when the upstream was never asked (the sidecar had no room, or the deadline was
    spent before a byte was written): that says nothing about its health, and a half-open
    probe that ends so must not decide the breaker's state either way. A connect failure is
    a failure: nothing was sent, but the upstream could not be reached. When the LAST attempt
    was refused locally but an earlier one reached the upstream and failed (``failed_before``),
    that earlier failure is the verdict.
    """
    local = isinstance(error, LocalOverload) or (
        isinstance(error, UpstreamError)
        and not error.reached_upstream
        and error.kind is not OutcomeKind.CONNECT_FAILURE
    )
    if local:
        return Verdict.FAILURE if failed_before else Verdict.NEUTRAL
    failed = sequence_failed(policy, final_status, error is not None)
    return Verdict.FAILURE if failed else Verdict.SUCCESS

"""Classification of one attempt's outcome, and the idempotency rules. Pure."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar import outcomes
from sidecar.config.model import IDEMPOTENT_METHODS, RetryPolicy
from sidecar.core import Fate, LocalOverload, UpstreamError, Verdict
from sidecar.outcomes import Effect, OutcomeKind

# ``x-retry-proxy-error`` codes with which a sidecar further down refused to ask its upstream:
# that tier has judged its upstream already (breaker open, no room); retrying into the same
# refusal helps nobody, and counting it again here would open every breaker up the chain, each
# with its own recovery clock.
REFUSED_BELOW = {
    outcomes.BREAKER_OPEN.code: Fate.BREAKER_OPEN,
    outcomes.CONCURRENCY_LIMIT.code: Fate.OVERLOADED,
    outcomes.OVERLOADED.code: Fate.OVERLOADED,
    outcomes.POOL_EXHAUSTED.code: Fate.OVERLOADED,
}
# Fates of a sequence whose wanted retry a limit of this sidecar refused although the upstream
# was reachable: the retry might have succeeded, so the failure so far is no evidence that the
# upstream is down -- unless it accepts almost nothing (``down``).
CUT_SHORT = frozenset({Fate.BUDGET_EXHAUSTED, Fate.THROTTLED})


# Not frozen: one is made per attempt, and under the compiled build a dataclass __init__ stays
# interpreted, where a frozen one costs 3-5x a plain one (object.__setattr__ per field).
# Treated as immutable all the same.
@dataclass(slots=True, init=False)
class Outcome:
    """What one attempt produced, in the project's own terms (no aiohttp types)."""

    kind: OutcomeKind
    status: int = 0
    retry_after: str | None = None  # the raw Retry-After header of a response
    detail: str = ""
    refused_below: Fate | None = None  # a sidecar further down refused (see REFUSED_BELOW)
    grpc: int = -1  # a gRPC call's status before it was committed; -1: none
    pushback: str | None = None  # its grpc-retry-pushback-ms, raw

    # An explicit __init__: mypyc compiles it, where the one @dataclass generates stays
    # interpreted (~3,000 instructions per object made, against ~300). One is made per attempt.
    def __init__(
        self,
        kind: OutcomeKind,
        status: int = 0,
        retry_after: str | None = None,
        detail: str = "",
        refused_below: Fate | None = None,
        *,
        grpc: int = -1,
        pushback: str | None = None,
    ) -> None:
        self.kind = kind
        self.status = status
        self.retry_after = retry_after
        self.detail = detail
        self.refused_below = refused_below
        self.grpc = grpc
        self.pushback = pushback

    @property
    def label(self) -> str:
        """A bounded word for metrics and spans: a status code or the failure kind."""
        if self.kind is OutcomeKind.RESPONSE:
            return str(self.status) if self.grpc <= 0 else outcomes.grpc_name(self.grpc)
        return outcomes.label(self.kind)


# The writes ``retry.non_idempotent`` governs. Any other method (BREW, LOCK, a method the sidecar
# has never heard of) says nothing about what resending it would do: never resent once a byte
# of it may have reached the upstream, whatever the policy.
RESENDABLE_WRITES = frozenset({"POST", "PATCH"})


def is_retryable(policy: RetryPolicy, outcome: Outcome) -> bool:
    on = policy.retry_on
    if outcome.kind is OutcomeKind.RESPONSE:
        if outcome.grpc > 0:  # a gRPC call's failure: by its gRPC status (Envoy's retry-grpc-on)
            return outcome.grpc in on.grpc
        return outcome.status in on.statuses
    if outcome.grpc > 0:
        # A gRPC call broken after its request may have reached the upstream (a stream reset,
        # its connection lost): as gRPC reads it (CANCELLED, INTERNAL, UNAVAILABLE...), retried
        # only for a status the route lists, never by the ``reset`` word.
        return outcome.grpc in on.grpc
    return outcome.kind in on.kinds


def is_success(outcome: Outcome) -> bool:
    return outcome.kind is OutcomeKind.RESPONSE and outcome.status < 400 and outcome.grpc <= 0


def may_resend(policy: RetryPolicy, method: str, has_idempotency_key: bool) -> bool:
    """Whether a request whose bytes may have reached the upstream can be sent again."""
    if method in IDEMPOTENT_METHODS:
        return True
    if method not in RESENDABLE_WRITES:
        return False
    mode = policy.non_idempotent
    if mode == "always":
        return True
    if mode == "with-idempotency-key":
        return has_idempotency_key
    return False


def nothing_reached_upstream(outcome: Outcome) -> bool:
    """A connect failure: no byte of the request left this process, any method may be retried."""
    return outcome.kind is OutcomeKind.CONNECT_FAILURE


def sequence_failed(
    policy: RetryPolicy, final_status: int | None, errored: bool, *, final_grpc: int = -1
) -> bool:
    """The one breaker event of a sequence: failed when it ended on an upstream error, a 5xx,
    or a status the policy treats as retryable (429 when listed), or a gRPC status it lists
    (as a listed 503 is). 4xx answers (and other gRPC statuses) are the upstream working as
    intended."""
    if errored or final_status is None:
        return True
    if final_grpc > 0:
        return final_grpc in policy.retry_on.grpc
    return final_status >= 500 or final_status in policy.retry_on.statuses


def accepted(policy: RetryPolicy, outcome: Outcome) -> bool:
    """Did the upstream accept this attempt (the adaptive throttle's "accepts")? Any answer
    that is not a failure the policy would retry."""
    return outcome.kind is OutcomeKind.RESPONSE and not (
        outcome.refused_below is not None or is_retryable(policy, outcome)
    )


def verdict(
    policy: RetryPolicy,
    final_status: int | None,
    error: UpstreamError | LocalOverload | None,
    failed_before: bool = False,
    fate: Fate | None = None,
    down: bool = False,
    *,
    final_grpc: int = -1,
) -> Verdict:
    """What a finished sequence tells its breaker (one verdict per sequence): the breaker is
    for "down", so only a sequence that ran its policy to its end is evidence.

    - Neutral when a limit of this sidecar cut it short (``CUT_SHORT``: budget, throttle): a
      retry that might have succeeded was not made, which says nothing about the upstream being
      down. ``down`` (the upstream accepted almost none of the route's recent attempts, see
      ``throttle.DOWN_ACCEPT_RATIO``) makes it a failure after all: in a full outage the
      throttle refuses every retry, and a breaker that ignored those sequences would never see
      the outage.
    - Neutral when a sidecar further down refused it (breaker open, no room there): that tier
      has judged its upstream already.
    - Neutral when the upstream was never asked (the sidecar had no room, or the deadline was
      spent before a byte was written: the error's row of ``sidecar.outcomes`` does not count
      for the breaker); when the LAST attempt was refused so but an earlier one
      reached the upstream and failed (``failed_before``), that earlier failure is the verdict.
    - A connect failure is a failure (its row counts for the breaker): nothing was sent, but
      the upstream could not be reached.

    A half-open probe that ends neutral does not decide the breaker's state either way.
    """
    if fate in CUT_SHORT:
        return Verdict.FAILURE if down else Verdict.NEUTRAL
    if fate is Fate.BREAKER_OPEN:
        return Verdict.NEUTRAL
    if error is not None and error.answer.breaker is Effect.NOT_COUNTED:
        return Verdict.FAILURE if failed_before else Verdict.NEUTRAL
    failed = sequence_failed(policy, final_status, error is not None, final_grpc=final_grpc)
    return Verdict.FAILURE if failed else Verdict.SUCCESS

"""The seam: the one entry point the request handler calls for a route with ``idempotency``.

``guarded`` judges the request (method, key), claims its key in the store, calls ``forward``
(which sends the request upstream, through the route's retries, and gives back the app's answer
with "the route would retry this") at most once, and keeps or releases the key. It owns the
claim, and renews its lease while ``forward`` runs (the process's one renewal timer,
``holding.Holdings``: no task per request). The key is settled by the app's answer: kept, or
released when the route would retry it (a status in ``retry_on``, a connect failure, a reset, a
timeout, an answer the sidecar made itself), by a store call awaited inline; a caller cancelled
meanwhile hands the settlement to the background retrier (``Holdings.settle_later``, which tries
it again until it lands: a complete or a release is a compare-and-set on the claim's token, so
one that landed already is not done twice) before the cancellation goes on. Once the app's
answer head came (``answered``, filled by the forward side) the app has acted: whatever ends
``forward`` after that, the key is settled by that answer (its status kept, its body not). When
``forward`` ends without any answer (an exception, a cancellation half-way: a stop whose drain
ran out) the request may have reached the app, so the key is left in progress until its lease,
as a killed sidecar leaves it. (The handler runs the guard in a task a client that leaves does
not cancel: ``proxy/detached.py``.)

What the handler does with the result: an ``Answer`` is the sidecar's own (a problem, a replay
with ``Idempotent-Replayed: true``): sent as is, the app never called; a ``Forwarded`` is the
app's answer, relayed as usual (or already streamed when its body is None). ``outcome`` is the
``result`` label to count, None when the route does not guard this request (disabled, or a
method it does not guard): ``forward`` was called as without the guard.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from sidecar.core import Clock
from sidecar.idempotency import problem
from sidecar.idempotency.answer import Answer, Forwarded, Headers
from sidecar.idempotency.decision import retry_after
from sidecar.idempotency.fingerprint import fingerprint, legacy_key, scope_digest, stored_key
from sidecar.idempotency.holding import Holdings
from sidecar.idempotency.keep import Disposition, dispose, kept, replay
from sidecar.idempotency.key import BadKey, NoKey, parse_key
from sidecar.idempotency.outcome import IdempotencyOutcome as O
from sidecar.idempotency.policy import IdempotencyPolicy
from sidecar.idempotency.store import (
    Busy,
    Claimed,
    Finished,
    IdempotencyStore,
    Kept,
    Mismatch,
    StoreError,
    StoreFull,
)

log = logging.getLogger("sidecar.idempotency")

# The handler's face to the answers made before a key is read (a body too large to guard).
body_too_large = problem.body_too_large

Forward = Callable[[], Awaitable[Forwarded]]
# The app's answer head, once it came (its body None: not held), else None: filled by the
# forward side when the head arrives, read by the guard when ``forward`` ends without a result.
Answered = Callable[[], Forwarded | None]


@dataclass(frozen=True, slots=True)
class RequestView:
    """What the guard reads of a request."""

    method: str
    target: bytes  # as sent, query included
    headers: Headers  # as they go upstream: hop-by-hop ones (and those Connection names) out
    body: bytes  # whole: a guarded write's body is buffered so it can be fingerprinted
    route_timeout: float  # the route's ``timeout``: the lease when the policy sets none
    route: str  # the route's name: keys live per route (``fingerprint.stored_key``)
    # The client's headers as received, before anything was stripped (hop-by-hop fields, those
    # ``Connection`` names, ``Proxy-*``): the scope is read from them, so a credential the
    # sidecar does not send upstream still tells two clients apart. None: ``headers``.
    received: Headers | None = None


@dataclass(frozen=True, slots=True)
class GuardResult:
    answer: Answer | Forwarded
    outcome: O | None


async def guarded(
    policy: IdempotencyPolicy,
    store: IdempotencyStore,
    request: RequestView,
    forward: Forward,
    clock: Clock,
    *,
    answered: Answered | None = None,
    holdings: Holdings | None = None,
) -> GuardResult:
    """``holdings``: the process's held keys and background settlements (``app.py``'s one);
    None: this call's own (no other claim of this process is seen)."""
    if holdings is None:
        holdings = Holdings(clock)
    if not policy.guards(request.method):
        return GuardResult(await forward(), None)
    parsed = parse_key(request.headers)
    if isinstance(parsed, BadKey):
        return GuardResult(problem.invalid_key(parsed.reason, parsed.raw), O.INVALID)
    if isinstance(parsed, NoKey):
        if policy.required:
            return GuardResult(problem.missing_key(), O.MISSING)
        return GuardResult(await forward(), O.MISSING)
    key = parsed.value
    received = request.headers if request.received is None else request.received
    scope = scope_digest(received, policy.scope_header)
    fp = fingerprint(request.method, request.target, request.body, scope)
    skey = stored_key(key, scope, request.route)
    lease = policy.lease_for(request.route_timeout)
    if holdings.holds(skey):  # a live request of this process: never taken over
        if holdings.fingerprint_of(skey) != fp:
            return GuardResult(problem.mismatch(key), O.MISMATCH)
        wait = retry_after(clock.wall() + holdings.lease_of(skey), clock.wall())
        return GuardResult(problem.in_progress(key, wait), O.IN_PROGRESS)
    try:
        claim = await store.claim(skey, fp, lease, legacy_key(key, scope))
    except StoreError as exc:
        warnings = holdings.store_warnings
        if warnings.allow(clock.monotonic()):
            left = warnings.suppressed
            more = f" ({left} more like it left out since start, 10 a minute)" if left else ""
            log.warning(
                "idempotency store unavailable (%s): %s%s", policy.on_store_error, exc, more
            )
        failed = O.STORE_FULL if isinstance(exc, StoreFull) else O.STORE_ERROR
        if policy.on_store_error == "pass":
            return GuardResult(await forward(), failed)
        return GuardResult(problem.store_unavailable(key), failed)
    if isinstance(claim, Busy):
        return GuardResult(
            problem.in_progress(key, retry_after(claim.expiry, clock.wall())), O.IN_PROGRESS
        )
    if isinstance(claim, Mismatch):
        return GuardResult(problem.mismatch(key), O.MISMATCH)
    if isinstance(claim, Finished):
        assert claim.record.answer is not None
        return GuardResult(replay(key, claim.record.answer), O.REPLAYED)
    holdings.take(skey, fp, lease)
    settling = _Settling(policy, store, skey, claim, holdings)
    try:
        return await _run_claimed(settling, forward, answered=answered, lease=lease)
    finally:
        if not settling.handed_over:
            holdings.let_go(skey)


@dataclass(slots=True)
class _Settling:
    """One claim on its way to being settled."""

    policy: IdempotencyPolicy
    store: IdempotencyStore
    skey: str
    claim: Claimed
    holdings: Holdings
    handed_over: bool = False  # to a background retrier, which lets the key go at its end


async def _run_claimed(
    settling: _Settling,
    forward: Forward,
    *,
    answered: Answered | None,
    lease: float,
) -> GuardResult:
    holdings, skey = settling.holdings, settling.skey
    holdings.renew_while_held(settling.store, skey, settling.claim.token, lease)
    try:
        forwarded = await forward()
    except BaseException:
        holdings.stop_renewing(skey)
        head = answered() if answered is not None else None
        if head is not None:
            # The app's answer head came: the app acted, whatever broke after (the client
            # gone mid-body, a cancellation): its key is settled by that answer, body not kept.
            await _settle_by(settling, head)
            raise
        # Failed or cancelled half-way (a stop whose drain ran out, a bound): the request may
        # have reached the app, and nobody will hear its answer. The key is left in progress
        # until its lease, as a killed sidecar leaves it: a duplicate gets 409 meanwhile. (A
        # failure known to be before any byte reached the app -- a connect failure, a refusal
        # by the sidecar -- is an answer ``forward`` returns, and releases the key.)
        log.warning("idempotency key %r ended without an answer: in progress until its lease", skey)
        raise
    holdings.stop_renewing(skey)
    return await _settle_by(settling, forwarded)


async def _settle_by(settling: _Settling, forwarded: Forwarded) -> GuardResult:
    """Keep or release the key by the app's answer. A store error hands the settlement to a
    background retrier (``holding``): the answer goes out now, the key is kept (or released)
    as soon as the store takes it, and stays held, its lease renewed, until then."""
    policy, store, skey, claim = settling.policy, settling.store, settling.skey, settling.claim
    disposition = dispose(forwarded, policy.max_response_bytes)
    settle: Callable[[], Awaitable[int]]
    if disposition is Disposition.RELEASE:

        def settle() -> Awaitable[int]:
            return store.release(skey, claim.token)

        outcome = O.RELEASED
    else:
        answer = kept(forwarded, disposition)

        def settle() -> Awaitable[int]:
            return store.complete(skey, claim.token, answer, policy.ttl)

        outcome = O.FIRST
    full = False
    try:
        settled: int | None = await settle()
    except StoreError as exc:
        settled, full = None, isinstance(exc, StoreFull)
    except asyncio.CancelledError:
        # Cancelled mid-call (a stop, the bound of a write whose client left): the call may
        # or may not land; the retrier carries it on (the key held meanwhile) either way.
        settling.holdings.settle_later(store, skey, claim.token, settle, policy.ttl)
        settling.handed_over = True
        raise
    if settled is None:
        # A Redis at its maxmemory refusing the keep (even without the body) is store-full.
        outcome = O.STORE_FULL if full else O.STORE_ERROR
        settling.holdings.settle_later(store, skey, claim.token, settle, policy.ttl)
        settling.handed_over = True
    elif claim.took_over:
        outcome = O.LEASE_EXPIRED  # counted whatever came of it: the at-least-once window
    elif settled == Kept.WITHOUT_BODY:
        outcome = O.STORE_FULL  # finished, its body not kept: the store is at its bound
    return GuardResult(forwarded, outcome)

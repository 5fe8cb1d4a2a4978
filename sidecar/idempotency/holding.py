"""The keys this process holds, and the settlements it carries on in the background.

A key is *held* from its claim to the end of its claim (kept, released, its settlement given
up, or its request cancelled without an answer). While its request runs, its lease is renewed
every third of it (``renew_while_held``), so the lease only means how long a key stays in
progress if its sidecar dies, never how long a live request may take. One timer renews every held
key (``renewals``: the next one due on the loop's clock), not a task per key: a task is made only
when renewals are due, one for all the keys due then. A claim of a held key is ``Busy`` without
asking the store's expiry: a live request of this process is never taken over, whatever the
wall clock says (an NTP step, a store whose lease stamps another clock wrote).

A settlement (``complete`` or ``release``) that failed with a store error (a Redis stall as the
app answers) is handed to a background retrier (``settle_later``): it renews the lease, so a
duplicate meanwhile gets 409, and tries the settlement again with a backoff until it lands, the
key is not ours any more, or its bound passes (the key's ttl), or the process stops
(``stop``: every retrier cancelled, and its key let go). Only while the sidecar lives: a
sidecar that dies with a retrier running leaves the key in progress until its lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from sidecar.core import Clock
from sidecar.idempotency.store import IdempotencyStore, StoreError
from sidecar.telemetry.logs import RateLimit

log = logging.getLogger("sidecar.idempotency")

RETRY_FIRST = 0.1  # seconds before the first retry of a settlement; doubled each time
RETRIER_TASK = "idempotency-settle"
# The holder renews its lease every third of it, so two renewals may fail (a slow store) before
# it runs out; never more often than this (a lease of a fraction of a second).
RENEW_FLOOR = 0.05
RENEW_TASK = "idempotency-renew"

Settle = Callable[[], Awaitable[int]]  # true: landed (``Kept`` or a release's bool)


def retry_delay(failures: int, lease: float) -> float:
    """The pause after ``failures`` failed settlements: 0.1 s doubling, never longer than a
    third of the lease, so the lease is renewed before it can run out. Pure."""
    cap = max(RETRY_FIRST, lease / 3)
    return float(min(cap, RETRY_FIRST * 2 ** max(0, failures - 1)))


def renew_every(lease: float) -> float:
    """How often a holder renews a ``lease``-second lease while its request runs. Pure."""
    return max(RENEW_FLOOR, lease / 3)


class _Renewal:
    """One held key's heartbeat: its claim, and when it is next renewed (the loop's clock)."""

    __slots__ = ("due", "lease", "store", "token")

    def __init__(self, store: IdempotencyStore, token: str, lease: float, due: float) -> None:
        self.store = store
        self.token = token
        self.lease = lease
        self.due = due


class Holdings:
    """The held keys (each with its lease) and the background settlements of one process."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._held: dict[str, tuple[str, float]] = {}  # key: (fingerprint, lease)
        self._retriers: set[asyncio.Task[None]] = set()
        self.given_up = 0  # settlements that never landed within their bound
        # The warning a guarded write logs when the store cannot answer: at most 10 a minute
        # (an outage of the store would otherwise log one line per request).
        self.store_warnings = RateLimit(per_interval=10, interval=60.0)
        self._renewals: dict[str, _Renewal] = {}
        self._timer: asyncio.TimerHandle | None = None  # fires when the first renewal is due
        self._timer_at = 0.0
        self._renewing: asyncio.Task[None] | None = None  # the renewals due, in flight

    def holds(self, key: str) -> bool:
        return key in self._held

    def fingerprint_of(self, key: str) -> str:
        return self._held[key][0]

    def lease_of(self, key: str) -> float:
        return self._held[key][1]

    def take(self, key: str, fingerprint: str, lease: float) -> None:
        self._held[key] = (fingerprint, lease)

    def let_go(self, key: str) -> None:
        self._held.pop(key, None)
        self.stop_renewing(key)

    # -- the lease's heartbeat: one timer for every held key ------------------------------------

    def renew_while_held(self, store: IdempotencyStore, key: str, token: str, lease: float) -> None:
        """Renew the claim's lease every third of it until ``stop_renewing`` (or ``let_go``)."""
        loop = asyncio.get_running_loop()
        renewal = _Renewal(store, token, lease, loop.time() + renew_every(lease))
        self._renewals[key] = renewal
        self._arm(loop, renewal.due)

    def stop_renewing(self, key: str) -> None:
        if self._renewals.pop(key, None) is not None and not self._renewals:
            timer, self._timer = self._timer, None
            if timer is not None:
                timer.cancel()

    @property
    def renewing(self) -> frozenset[str]:
        """The keys whose lease is being renewed."""
        return frozenset(self._renewals)

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        if self._renewing is not None:
            return  # the renewals in flight arm the timer again when they end
        if self._timer is not None:
            if self._timer_at <= due:
                return
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(due, self._due), due

    def _due(self) -> None:
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = [(k, r) for k, r in self._renewals.items() if r.due <= now]
        if due:
            self._renewing = loop.create_task(self._renew(due), name=RENEW_TASK)
        else:
            self._rearm(loop)

    def _rearm(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._renewals:
            self._arm(loop, min(r.due for r in self._renewals.values()))

    async def _renew(self, due: list[tuple[str, _Renewal]]) -> None:
        try:
            await asyncio.gather(*(self._renew_one(key, r) for key, r in due))
        finally:
            self._renewing = None
            self._rearm(asyncio.get_running_loop())

    async def _renew_one(self, key: str, renewal: _Renewal) -> None:
        every = renew_every(renewal.lease)
        try:
            ours = await renewal.store.renew(key, renewal.token, renewal.lease)
        except StoreError as exc:
            log.warning("idempotency lease not renewed (next try in %.2fs): %s", every, exc)
            ours = True  # tried again at the next beat
        if self._renewals.get(key) is not renewal:
            return  # let go meanwhile
        if ours:
            renewal.due = asyncio.get_running_loop().time() + every
        else:  # not ours any more (forgotten, taken over): nothing left to hold
            del self._renewals[key]

    @property
    def held(self) -> frozenset[str]:
        return frozenset(self._held)

    @property
    def retrying(self) -> int:
        return len(self._retriers)

    def settle_later(
        self, store: IdempotencyStore, key: str, token: str, settle: Settle, bound: float
    ) -> None:
        """Retry ``settle`` in the background until it lands (the key stays held meanwhile and
        its lease renewed), for at most ``bound`` seconds."""
        if key not in self._held:  # not held (never, or let go already): nothing to carry on
            return
        ends = self._clock.monotonic() + bound
        task = asyncio.get_running_loop().create_task(
            self._retry(store, key, token, settle, ends), name=RETRIER_TASK
        )
        self._retriers.add(task)
        task.add_done_callback(self._retriers.discard)

    async def _retry(
        self, store: IdempotencyStore, key: str, token: str, settle: Settle, ends: float
    ) -> None:
        lease = self.lease_of(key)
        failures = 1
        try:
            while self._clock.monotonic() < ends:
                await asyncio.sleep(retry_delay(failures, lease))
                try:
                    await settle()  # True: landed; False: not ours any more. Either way done.
                    log.info("idempotency key %r settled after %d tries", key, failures + 1)
                    return
                except StoreError:
                    failures += 1
                try:
                    if not await store.renew(key, token, lease):
                        return  # taken over or forgotten: nothing left to settle
                except StoreError:
                    pass
            self.given_up += 1
            log.warning(
                "idempotency key %r not settled within its bound (%d tries): in progress "
                "until its lease",
                key,
                failures,
            )
        finally:
            self.let_go(key)

    async def stop(self) -> None:
        """Cancel every retrier and the renewals (at process stop) and wait for them: their keys
        let go, left in progress until their lease."""
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        self._renewals.clear()
        tasks = set(self._retriers)
        if self._renewing is not None:
            tasks.add(self._renewing)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

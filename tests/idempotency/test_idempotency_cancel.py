"""A guarded write cancelled at random points (its claim, its forward, its lease renewals, the
store call that settles it): every resource it took is given back -- the key let go, its renewal
stopped, no task left -- and its key is finished exactly when the app answered. On each backend
(SQLite, whose calls do not suspend; a real Redis, whose do)."""

from __future__ import annotations

import asyncio
import random

import pytest

from sidecar.idempotency.answer import Forwarded
from sidecar.idempotency.fingerprint import NO_SCOPE, stored_key
from sidecar.idempotency.guard import Forward, GuardResult, RequestView, guarded
from sidecar.idempotency.holding import RENEW_TASK, RETRIER_TASK, Holdings
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.policy import IdempotencyPolicy
from sidecar.idempotency.store import IdempotencyStore
from sidecar.testing import FakeClock
from tests.idempotency import test_idempotency_store as contract
from tests.idempotency.test_idempotency_store import WithStore
from tests.wait import until

pytestmark = pytest.mark.slow  # a real redis-server per case

run, db, clock, with_store = contract.run, contract.db, contract.clock, contract.with_store

# A lease of a fraction of a second: its renewals (every 50 ms) fall among the cancellations.
POLICY = IdempotencyPolicy(enabled=True, lease=0.15)
ROUNDS = 40


def _view(key: str) -> RequestView:
    headers = ((b"Idempotency-Key", key.encode()),)
    return RequestView("POST", b"/orders", headers, b"{}", 1.0, "orders")


def _tasks_left() -> set[str]:
    names = {RENEW_TASK, RETRIER_TASK}
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name() in names}


def test_a_guarded_write_cancelled_at_random_points_leaves_nothing_held(
    with_store: WithStore, clock: FakeClock
) -> None:
    rng = random.Random(17)

    async def main(store: IdempotencyStore) -> None:
        holdings = Holdings(clock)
        answered: set[str] = set()

        loop = asyncio.get_running_loop()

        def forward_of(key: str, takes: float, cut: float | None) -> Forward:
            async def forward() -> Forwarded:
                if cut is not None:  # cut while the app works: timers on one clock, so
                    loop.call_later(cut, tasks[key].cancel)  # which comes first is seeded
                await asyncio.sleep(takes)
                answered.add(key)
                return Forwarded(201, (), key.encode(), False)

            return forward

        # Half the writes are cut at a random moment from their start (in the claim, the
        # renewals, the settle: wherever a loaded machine has them then), half at a random
        # moment of the app's work, before or after it answers, whatever the store's speed.
        tasks: dict[str, asyncio.Task[GuardResult]] = {}
        for i in range(ROUNDS):
            key = f"cut-{i}"
            takes, cut = rng.uniform(0.0, 0.12), rng.uniform(0.0, 0.15)
            forward = forward_of(key, takes, cut if i % 2 else None)
            tasks[key] = asyncio.ensure_future(
                guarded(POLICY, store, _view(key), forward, clock, holdings=holdings)
            )
            if i % 2 == 0:
                loop.call_later(cut, tasks[key].cancel)
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        await until(
            lambda: not holdings.held and not holdings.retrying and not _tasks_left(),
            "every key let go, no renewal or retrier left",
        )
        assert not holdings.renewing
        for key in tasks:
            record = await store.get(stored_key(key, NO_SCOPE, "orders"))
            finished = record is not None and record.finished
            assert finished == (key in answered), (key, record)
            if finished:
                assert record is not None and record.answer == KeptAnswer(201, (), key.encode())
        assert 0 < len(answered) < ROUNDS  # cut both before and after the app answered
        await holdings.stop()

    with_store(main)

"""The seam of effectively-once writes, ``guard.guarded``, over the real SQLite store: every
contract bullet the guard owns, the claim given back on every exit (cancellation half-way
included), and a property test of 50 concurrent duplicates with random arrivals, answers,
cancellations and kills. Each scenario runs under asyncio and under uvloop (as shipped)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvloop

from sidecar.idempotency.answer import Answer, Forwarded
from sidecar.idempotency.fingerprint import NO_SCOPE, fingerprint, stored_key
from sidecar.idempotency.guard import GuardResult, RequestView, guarded
from sidecar.idempotency.holding import RENEW_TASK, Holdings
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.outcome import IdempotencyOutcome as O
from sidecar.idempotency.policy import IdempotencyPolicy
from sidecar.idempotency.sqlite import SqliteIdempotencyStore
from sidecar.idempotency.store import Claimed
from sidecar.testing import FakeClock
from tests.wait import until, until_async

Run = Callable[[Callable[[], Awaitable[Any]]], Any]
POLICY = IdempotencyPolicy(enabled=True, max_response_bytes=64)
JSON = ((b"Content-Type", b"application/json"),)


def view(
    key: bytes | None = b"k1", body: bytes = b"{}", method: str = "POST", **extra: bytes
) -> RequestView:
    headers = [(b"Host", b"app")]
    if key is not None:
        headers.append((b"Idempotency-Key", key))
    headers += [(k.replace("_", "-").encode(), v) for k, v in extra.items()]
    return RequestView(method, b"/orders", tuple(headers), body, route_timeout=60.0, route="orders")


@dataclass
class App:
    """A scripted ``forward``: counts calls and how many run at once."""

    answers: list[Forwarded] = field(
        default_factory=lambda: [Forwarded(201, JSON, b'{"id": 1}', False)]
    )
    calls: int = 0
    running: int = 0
    most: int = 0
    gate: asyncio.Event | None = None  # when set, each call waits for it
    entered: asyncio.Event = field(default_factory=asyncio.Event)

    async def forward(self) -> Forwarded:
        self.calls += 1
        self.running += 1
        self.most = max(self.most, self.running)
        self.entered.set()
        try:
            if self.gate is not None:
                await self.gate.wait()
            return self.answers[min(self.calls, len(self.answers)) - 1]
        finally:
            self.running -= 1


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request: pytest.FixtureRequest) -> Run:
    def go(main: Callable[[], Awaitable[Any]]) -> Any:
        async def wrapped() -> Any:
            return await main()

        return uvloop.run(wrapped()) if request.param == "uvloop" else asyncio.run(wrapped())

    return go


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def store(tmp_path: Path, clock: FakeClock) -> Iterator[SqliteIdempotencyStore]:
    s = SqliteIdempotencyStore(str(tmp_path / "idem.sqlite3"), clock)
    s.open()
    yield s
    s.close()


def problem_of(result: GuardResult) -> dict[str, Any]:
    assert isinstance(result.answer, Answer)
    assert result.answer.header(b"content-type") == b"application/problem+json"
    doc: dict[str, Any] = json.loads(result.answer.body)
    return doc


def test_unguarded_requests_pass_untouched(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        app = App()
        got = await guarded(POLICY, store, view(method="GET"), app.forward, clock)
        assert got.outcome is None and isinstance(got.answer, Forwarded)
        off = await guarded(IdempotencyPolicy(), store, view(), app.forward, clock)
        assert off.outcome is None
        assert app.calls == 2 and await store.get(stored_key("k1", NO_SCOPE, "orders")) is None

    run(main)


def test_missing_and_invalid_keys(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        app = App()
        passed = await guarded(POLICY, store, view(key=None), app.forward, clock)
        assert passed.outcome is O.MISSING and isinstance(passed.answer, Forwarded)
        required = IdempotencyPolicy(enabled=True, required=True)
        refused = await guarded(required, store, view(key=None), app.forward, clock)
        assert refused.outcome is O.MISSING and problem_of(refused)["status"] == 400
        for bad in (b"", b"a b", b"k" * 256, b'"open'):
            got = await guarded(POLICY, store, view(key=bad), app.forward, clock)
            assert got.outcome is O.INVALID and problem_of(got)["status"] == 400
        assert app.calls == 1

    run(main)


def test_first_then_replayed_then_mismatch(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        app = App()
        first = await guarded(POLICY, store, view(), app.forward, clock)
        assert first.outcome is O.FIRST and isinstance(first.answer, Forwarded)
        again = await guarded(POLICY, store, view(key=b'"k1"'), app.forward, clock)
        assert again.outcome is O.REPLAYED and isinstance(again.answer, Answer)
        assert (again.answer.status, again.answer.body) == (201, b'{"id": 1}')
        assert again.answer.header(b"idempotent-replayed") == b"true"
        other = await guarded(POLICY, store, view(body=b'{"n": 2}'), app.forward, clock)
        assert other.outcome is O.MISMATCH and problem_of(other) | {"detail": ""} == {
            "type": "urn:retry-sidecar:problem:idempotency:key-reused",
            "title": "Idempotency-Key reused for another request",
            "status": 422,
            "detail": "",
            "key": "k1",
        }
        assert app.calls == 1

    run(main)


def test_a_duplicate_while_in_progress_gets_409_with_the_remaining_lease(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        gate = asyncio.Event()
        app = App(gate=gate)
        first = asyncio.ensure_future(guarded(POLICY, store, view(), app.forward, clock))
        await app.entered.wait()
        clock.advance(20.0)
        busy = await guarded(POLICY, store, view(), app.forward, clock)
        assert busy.outcome is O.IN_PROGRESS and isinstance(busy.answer, Answer)
        assert busy.answer.status == 409 and busy.answer.header(b"retry-after") == b"45"
        gate.set()
        assert (await first).outcome is O.FIRST
        assert app.calls == 1

    run(main)


def test_an_answer_the_route_would_retry_releases_the_key(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        app = App(answers=[Forwarded(503, (), b"busy", True), Forwarded(201, JSON, b"made", False)])
        assert (await guarded(POLICY, store, view(), app.forward, clock)).outcome is O.RELEASED
        assert (await guarded(POLICY, store, view(), app.forward, clock)).outcome is O.FIRST
        assert (await guarded(POLICY, store, view(), app.forward, clock)).outcome is O.REPLAYED
        assert app.calls == 2

    run(main)


def test_an_answer_too_large_is_relayed_and_its_duplicate_gets_the_status(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        big = Forwarded(201, JSON, b"x" * 65, False)
        app = App(answers=[big])
        first = await guarded(POLICY, store, view(), app.forward, clock)
        assert first.outcome is O.FIRST and first.answer is big
        dup = await guarded(POLICY, store, view(), app.forward, clock)
        assert dup.outcome is O.REPLAYED and problem_of(dup)["type"].endswith("answer-not-kept")
        assert isinstance(dup.answer, Answer) and dup.answer.status == 201
        assert app.calls == 1

    run(main)


def test_scope_header_keeps_clients_apart(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    policy = IdempotencyPolicy(enabled=True, scope_header="Authorization")

    async def main() -> None:
        app = App(answers=[Forwarded(201, (), b"alice", False), Forwarded(201, (), b"bob", False)])
        a = await guarded(policy, store, view(Authorization=b"Bearer alice"), app.forward, clock)
        b = await guarded(policy, store, view(Authorization=b"Bearer bob"), app.forward, clock)
        assert a.outcome is O.FIRST and b.outcome is O.FIRST
        again = await guarded(policy, store, view(Authorization=b"Bearer bob"), app.forward, clock)
        assert isinstance(again.answer, Answer) and again.answer.body == b"bob"
        assert app.calls == 2

    run(main)


def test_a_cancellation_half_way_leaves_the_key_in_progress_until_its_lease(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    """Cancelled with no answer yet (a stop whose drain ran out): the request may have reached
    the app, so the key is not given back: in progress until its lease, as a killed sidecar
    leaves it; a duplicate meanwhile gets 409, and one after the lease is a takeover."""

    async def main() -> None:
        gate = asyncio.Event()
        app = App(gate=gate)
        task = asyncio.ensure_future(guarded(POLICY, store, view(), app.forward, clock))
        await app.entered.wait()  # claimed, and the request is with the app
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        record = await store.get(stored_key("k1", NO_SCOPE, "orders"))
        assert record is not None and not record.finished
        gate.set()
        assert (await guarded(POLICY, store, view(), app.forward, clock)).outcome is O.IN_PROGRESS
        clock.advance(POLICY.lease_for(60.0))
        again = await guarded(POLICY, store, view(), app.forward, clock)
        assert again.outcome is O.LEASE_EXPIRED and app.calls == 2

    run(main)


def test_a_timeout_or_an_exception_around_forward_leaves_the_key_in_progress(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        app = App(gate=asyncio.Event())  # never set: the app never answers
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(guarded(POLICY, store, view(), app.forward, clock), 0.05)
        record = await store.get(stored_key("k1", NO_SCOPE, "orders"))
        assert record is not None and not record.finished

        async def broken() -> Forwarded:
            raise RuntimeError("boom")

        with pytest.raises(RuntimeError):
            await guarded(POLICY, store, view(key=b"k2"), broken, clock)
        record = await store.get(stored_key("k2", NO_SCOPE, "orders"))
        assert record is not None and not record.finished

    run(main)


def test_a_cancellation_while_completing_still_completes(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    """The app answered, and the client leaves at that instant: the cancellation reaches the
    guard at its next await, the store call that completes the key. It still completes."""

    async def main() -> None:
        async def forward() -> Forwarded:
            me = asyncio.current_task()
            assert me is not None
            me.cancel()  # delivered at the guard's next await
            return Forwarded(201, (), b"made", False)

        holdings = Holdings(clock)
        # Its own task, as the handler runs it: the cancellation ends that task, whether it
        # lands in the store call (a store that suspends) or after it (SQLite's, inline).
        task = asyncio.ensure_future(
            guarded(POLICY, store, view(), forward, clock, holdings=holdings)
        )
        with pytest.raises(asyncio.CancelledError):
            await task
        key = stored_key("k1", NO_SCOPE, "orders")
        await until(lambda: not holdings.held and not holdings.retrying, "the key settled")
        record = await store.get(key)
        assert record is not None and record.finished
        assert record.answer == KeptAnswer(201, (), b"made")

    run(main)


@pytest.mark.parametrize("mode", ["refuse", "pass"])
def test_a_store_that_cannot_answer(run: Run, tmp_path: Path, clock: FakeClock, mode: str) -> None:
    store = SqliteIdempotencyStore(str(tmp_path / "never-opened.sqlite3"), clock)
    policy = IdempotencyPolicy(enabled=True, on_store_error=mode)  # type: ignore[arg-type]

    async def main() -> None:
        app = App()
        got = await guarded(policy, store, view(), app.forward, clock)
        assert got.outcome is O.STORE_ERROR
        if mode == "refuse":
            assert problem_of(got)["status"] == 503 and app.calls == 0
        else:
            assert isinstance(got.answer, Forwarded) and app.calls == 1

    run(main)


def test_a_store_outage_is_warned_about_ten_times_a_minute_not_per_request(
    run: Run, tmp_path: Path, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Each guarded write that finds the store unable to answer used to log its own warning:
    an outage flooded the log at the request rate."""
    store = SqliteIdempotencyStore(str(tmp_path / "never-opened.sqlite3"), clock)
    policy = IdempotencyPolicy(enabled=True, on_store_error="refuse")
    holdings = Holdings(clock)

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "store unavailable" in r.getMessage()]

    async def main() -> None:
        app = App()
        for _ in range(100):
            got = await guarded(policy, store, view(), app.forward, clock, holdings=holdings)
            assert got.outcome is O.STORE_ERROR
        assert len(warnings()) == 10
        clock.advance(60.0)
        await guarded(policy, store, view(), app.forward, clock, holdings=holdings)
        assert len(warnings()) == 11 and "90 more like it left out" in warnings()[-1]

    with caplog.at_level("WARNING", logger="sidecar.idempotency"):
        run(main)


def test_a_dead_holders_key_is_taken_over_after_its_lease_and_counted(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    async def main() -> None:
        app = App()
        request = view()
        # What a sidecar killed mid-request leaves: a claim nobody will complete or release.
        fp = fingerprint("POST", request.target, request.body, NO_SCOPE)
        assert isinstance(
            await store.claim(stored_key("k1", NO_SCOPE, "orders"), fp, 65.0), Claimed
        )
        assert (await guarded(POLICY, store, request, app.forward, clock)).outcome is O.IN_PROGRESS
        clock.advance(65.0)
        assert (
            await guarded(POLICY, store, request, app.forward, clock)
        ).outcome is O.LEASE_EXPIRED
        assert (await guarded(POLICY, store, request, app.forward, clock)).outcome is O.REPLAYED
        assert app.calls == 1

    run(main)


@pytest.mark.parametrize("end", ["cancelled", "raised"])
def test_once_the_answer_head_came_the_key_is_finished_whatever_ends_forward(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock, end: str
) -> None:
    """The app's head came (a large answer streamed, not held), then the forward ends without a
    result: cancelled (the client gone mid-body, a stop) or raising. The app acted: the key is
    finished with its status, the body not kept, and a duplicate is replayed that status."""

    async def main() -> None:
        head: list[Forwarded] = []
        gate = asyncio.Event()
        entered = asyncio.Event()

        async def forward() -> Forwarded:
            head.append(Forwarded(200, JSON, None, False))
            entered.set()
            await gate.wait()
            raise ConnectionError("the client went away mid-body")

        task = asyncio.ensure_future(
            guarded(POLICY, store, view(), forward, clock, answered=lambda: next(iter(head), None))
        )
        await entered.wait()
        if end == "cancelled":
            task.cancel()
        else:
            gate.set()
        with pytest.raises(asyncio.CancelledError if end == "cancelled" else ConnectionError):
            await task
        record = await store.get(stored_key("k1", NO_SCOPE, "orders"))
        assert record is not None and record.finished
        assert record.answer == KeptAnswer(200, (), None, None)
        app = App()
        again = await guarded(POLICY, store, view(), app.forward, clock)
        assert again.outcome is O.REPLAYED and app.calls == 0
        assert isinstance(again.answer, Answer) and again.answer.status == 200

    run(main)


def test_the_holder_renews_its_lease_while_forward_runs(
    run: Run, store: SqliteIdempotencyStore, clock: FakeClock
) -> None:
    """A request that runs longer than its lease (a slow body after an early head, a slow app)
    keeps its key: the guard renews the lease every third of it, so a duplicate past the first
    lease gets 409, never a takeover. Cancelled half-way, the heartbeat goes with the guard."""
    policy = IdempotencyPolicy(enabled=True, lease=0.3)

    async def main() -> None:
        app = App(gate=asyncio.Event())
        holdings = Holdings(clock)

        def _renewing() -> bool:
            return bool(holdings.renewing) or _renewal_tasks()

        task = asyncio.ensure_future(
            guarded(policy, store, view(), app.forward, clock, holdings=holdings)
        )
        await app.entered.wait()
        key = stored_key("k1", NO_SCOPE, "orders")
        first = await store.get(key)
        assert first is not None
        clock.advance(10.0)  # far past the first lease: only a renewal keeps the key
        await until_async(lambda: _expires_after(store, key, clock.wall()), "a renewal")
        dup = await guarded(policy, store, view(), App().forward, clock)
        assert dup.outcome is O.IN_PROGRESS
        assert _renewing(), "the heartbeat runs while forward does"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(lambda: not _renewing(), "no heartbeat left after a cancellation half-way")
        app.gate = None
        done = await guarded(policy, store, view(key=b"k2"), app.forward, clock, holdings=holdings)
        assert done.outcome is O.FIRST
        await until(lambda: not _renewing(), "no heartbeat left after a return")

    run(main)


async def _expires_after(store: SqliteIdempotencyStore, key: str, wall: float) -> bool:
    record = await store.get(key)
    return record is not None and record.expires_at > wall


def _renewal_tasks() -> bool:
    return any(t.get_name() == RENEW_TASK for t in asyncio.all_tasks())

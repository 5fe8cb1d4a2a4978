"""Property: 50 concurrent duplicates of one keyed write, arriving in random order, each with a
random answer from the app (2xx kept, a retryable 503, too large to keep, an exception) or a
random end (cancelled half-way, its sidecar killed). Whatever the draw: ``forward`` never runs
twice at once for the key, runs at most once with an answer that is kept, never after that,
and every duplicate that came later is replayed that answer. The real SQLite store; a kill is a
claim whose holder never completes nor releases it, taken over once the fake clock passes its
lease (the second wave)."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.idempotency.answer import Answer, Forwarded
from sidecar.idempotency.guard import GuardResult, RequestView, guarded
from sidecar.idempotency.keep import KeptAnswer
from sidecar.idempotency.outcome import IdempotencyOutcome as O
from sidecar.idempotency.policy import IdempotencyPolicy
from sidecar.idempotency.sqlite import SqliteIdempotencyStore
from sidecar.idempotency.store import Claimed, ClaimResult, Kept
from sidecar.testing import FakeClock

N = 50
POLICY = IdempotencyPolicy(enabled=True, max_response_bytes=16, lease=30.0)
REQUEST = RequestView(
    "POST",
    b"/pay",
    ((b"Idempotency-Key", b"pay-1"),),
    b'{"amount": 5}',
    route_timeout=25.0,
    route="orders",
)
KINDS = ("ok", "retry", "large", "raise", "cancel", "kill")


class Dying(SqliteIdempotencyStore):
    """The store as seen by a fleet of one: a holder marked dead never settles its claim."""

    def __init__(self, path: str, clock: FakeClock) -> None:
        super().__init__(path, clock)
        self.last_token: str | None = None
        self.dead: set[str] = set()

    async def claim(
        self, key: str, fingerprint: str, lease: float, legacy: str | None = None
    ) -> ClaimResult:
        got = await super().claim(key, fingerprint, lease, legacy)
        if isinstance(got, Claimed):
            self.last_token = got.token
        return got

    async def complete(self, key: str, token: str, answer: KeptAnswer, ttl: float) -> Kept:
        if token in self.dead:
            return Kept.NOT_OURS
        return await super().complete(key, token, answer, ttl)

    async def release(self, key: str, token: str) -> bool:
        return False if token in self.dead else await super().release(key, token)


@dataclass
class Trace:
    running: int = 0
    most: int = 0
    kept: list[bytes] = field(default_factory=list)  # bodies of forwards whose answer is kept
    started_after_kept: int = 0


def app_for(i: int, kind: str, yields: int, store: Dying, trace: Trace):  # type: ignore[no-untyped-def]
    async def forward() -> Forwarded:
        if trace.kept:
            trace.started_after_kept += 1
        trace.running += 1
        trace.most = max(trace.most, trace.running)
        try:
            for _ in range(yields):
                await asyncio.sleep(0)
            me = asyncio.current_task()
            assert me is not None
            if kind in ("cancel", "kill"):
                if kind == "kill":
                    assert store.last_token is not None
                    store.dead.add(store.last_token)
                asyncio.get_running_loop().call_soon(me.cancel)
                await asyncio.Event().wait()
            if kind == "raise":
                raise ConnectionError("app went away")
            if kind == "retry":
                return Forwarded(503, (), b"busy", retryable=True)
            body = f"answer {i}".encode() + (b"!" * 20 if kind == "large" else b"")
            trace.kept.append(body)
            return Forwarded(201, (), body, retryable=False)
        finally:
            trace.running -= 1

    return forward


async def wave(
    kinds: list[str],
    arrivals: list[int],
    yields: list[int],
    store: Dying,
    clock: FakeClock,
    trace: Trace,
    base: int,
) -> list[GuardResult | str]:
    async def one(j: int) -> GuardResult | str:
        for _ in range(arrivals[j]):
            await asyncio.sleep(0)
        fwd = app_for(base + j, kinds[j], yields[j], store, trace)
        try:
            return await guarded(POLICY, store, REQUEST, fwd, clock)
        except asyncio.CancelledError:
            return "cancelled"
        except ConnectionError:
            return "raised"

    return list(await asyncio.gather(*(one(j) for j in range(len(kinds)))))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kinds=st.lists(st.sampled_from(KINDS), min_size=N, max_size=N),
    arrivals=st.lists(st.integers(0, 30), min_size=N, max_size=N),
    yields=st.lists(st.integers(0, 10), min_size=N, max_size=N),
)
def test_duplicates_reach_the_app_once_whatever_the_order(
    kinds: list[str], arrivals: list[int], yields: list[int]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        clock = FakeClock()
        store = Dying(str(Path(tmp) / "idem.sqlite3"), clock)
        store.open()
        trace = Trace()
        half = N // 2

        async def main() -> list[GuardResult | str]:
            first = await wave(kinds[:half], arrivals[:half], yields[:half], store, clock, trace, 0)
            clock.advance(POLICY.lease or 0.0)  # a killed holder's lease has passed
            second = await wave(
                kinds[half:], arrivals[half:], yields[half:], store, clock, trace, half
            )
            return first + second

        try:
            results = asyncio.run(main())
        finally:
            with contextlib.suppress(Exception):
                store.close()

    assert trace.most <= 1, "forward ran twice at once for one key"
    assert len(trace.kept) <= 1 and trace.started_after_kept == 0
    done = [r for r in results if isinstance(r, GuardResult)]
    outcomes = [r.outcome for r in done]
    assert all(o in set(O) for o in outcomes)
    kept_outcomes = sum(o in (O.FIRST, O.LEASE_EXPIRED) for o in outcomes)
    assert kept_outcomes >= len(trace.kept)  # a takeover whose answer was released counts too
    assert sum(o is O.FIRST for o in outcomes) <= 1
    if O.FIRST in outcomes:
        assert len(trace.kept) == 1
    for r in done:
        if r.outcome is O.REPLAYED:
            answer = r.answer
            assert isinstance(answer, Answer) and answer.status == 201
            assert len(trace.kept) == 1
            if len(trace.kept[0]) <= POLICY.max_response_bytes:
                assert answer.body == trace.kept[0]

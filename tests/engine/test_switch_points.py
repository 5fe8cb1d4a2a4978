"""A kill switch or a drain at random points of retried sequences: no retry starts after it.

Eight sequences retry an upstream that always answers 503 (ten attempts each, short jittered
backoffs); at a seeded random moment -- right after the k-th arrival at the upstream, or a
random few milliseconds later, so that sequences are caught mid-attempt and mid-backoff --
the test sets a kill switch for the route or starts the drain, and notes at that instant how
many attempts the sidecar had started (ended ones plus the tickets of the concurrency limit
held). Then:

- kill switch: not one attempt starts after it; every sequence still running ends
  ``kill-switch``;
- drain: no sequence makes more than the one final attempt a drain allows (the attempt in
  flight, or the retry whose backoff the drain cut short), and each ends ``draining``;
- either way, at the upstream no request arrives more than once after the instant, and the
  retries counted (``retries_total``'s event, the retry budget) are exactly the retries the
  upstream received.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from aiohttp import web

from tests.conftest import Running, routes_yaml

SEQUENCES = 8
ATTEMPTS = 10
ROUTE = f"""    timeout: 30s
    retry: {{attempts: {ATTEMPTS}, per_try_timeout: 5s,
             backoff: {{strategy: full_jitter, base: 2ms, max: 20ms}}}}
    throttle: {{enabled: false}}
    breaker: {{enabled: false}}
    budget: {{ratio: 10, min_per_second: 100}}
    bulkhead: {{adaptive: true}}  # its tickets count the attempts in flight
"""


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("what", ["kill-switch", "drain"])
async def test_nothing_starts_after_a_switch_or_a_drain(
    upstream_factory, sidecar_factory, client, what: str, seed: int
):
    rng = random.Random(seed)
    k = rng.randint(SEQUENCES + 1, SEQUENCES * ATTEMPTS * 3 // 4)
    delay = rng.choice([0.0, rng.uniform(0.0, 0.01)])
    arrivals: list[str] = []  # request path per arrival, in order
    at: dict[str, int] = {}  # at the instant: arrivals so far, attempts started
    running: list[Running] = []

    def trigger() -> None:
        [sc] = running
        side = sc.sidecar
        now = side.clock.monotonic()
        at["arrivals"] = len(arrivals)
        st = side.states.get("main")
        at["started"] = len(sc.recorder.attempts) + st.limiter.in_flight
        if what == "kill-switch":
            side.kill.set("route:main", 900.0, "test", "test", now, side.clock.wall())
        else:
            side.life.start_drain()

    async def handle(request: web.Request) -> web.StreamResponse:
        arrivals.append(request.path)
        if len(arrivals) == k:
            asyncio.get_running_loop().call_later(delay, trigger)
        return web.Response(status=503, text="down")

    up = await upstream_factory(handle)
    sc = await sidecar_factory(routes_yaml(up.url, ROUTE))
    running.append(sc)

    async def one(i: int) -> str:
        async with client.get(f"{sc.url}/r/{i}") as r:
            await r.read()
            return str(r.headers["x-retry-fate"])

    fates = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(SEQUENCES))), 60)
    assert at, "the switch point was never reached"
    attempts = len(sc.recorder.attempts)
    after = Counter(arrivals[at["arrivals"] :])
    assert all(n <= 1 for n in after.values()), after
    if what == "kill-switch":
        assert attempts == at["started"]  # not one attempt started after the switch
        assert set(fates) <= {"kill-switch", "exhausted"}
    else:
        assert set(fates) <= {"draining", "exhausted"}
    # Retries counted = retries the upstream received (each attempt reached it).
    assert len(arrivals) == attempts
    retries = len(sc.recorder.retries)
    assert retries == attempts - SEQUENCES
    st = sc.sidecar.states.get("main")
    assert st.budget.counts(sc.sidecar.clock.monotonic())[1] == retries

"""The hedged shape of a sequence: attempts racing as tasks owned by an ``AttemptSet``.

When the newest attempt has run for the per-try timeout without an answer, another one starts
beside it (if the concurrency limit, the throttle and the hedging budget allow; a refusal is
asked again later, backing off), preferably to another endpoint. The first usable answer wins
and the ``AttemptSet`` scope cancels the rest. A retryable failure while another attempt is
still running only waits for that one; when none is left, the driver's ``judge`` decides as in
a sequence of one attempt at a time.

This module is deliberately NOT compiled with mypyc (setup.py's list): its loop awaits inside
an ``async with`` that the client's cancellation unwinds with awaits of its own, and mypyc's
coroutines have corrupted the exception in flight on that path (a crash reproduced by
tests/engine/test_hedging.py under the compiled build). The decisions it calls are the compiled
driver's; only the waiting is here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sidecar.core import Fate, LocalOverload
from sidecar.engine.attempted import Attempted
from sidecar.engine.attempts import AttemptSet
from sidecar.retry.decide import Stop
from sidecar.telemetry.events import HedgeEvent

if TYPE_CHECKING:
    from sidecar.engine.loop import Driver, SequenceResult


async def hedged(driver: Driver, after: float) -> SequenceResult:
    d = driver
    last: Attempted | None = None  # a failure kept as the answer if nothing better comes
    answer: Attempted | None = None  # the attempt whose result is being returned
    try:
        async with AttemptSet() as running:
            d.start(running, hedge=False)
            started = d.clock.monotonic()
            hedge_at = started + after
            refused = False  # a hedge of the newest attempt was refused (reported once)
            hedging = True  # False once a kill switch or a drain stopped new hedges
            while True:
                wait: float | None = None
                if hedging and d.number < d.policy.attempts:
                    wait = max(0.0, hedge_at - d.clock.monotonic())
                a = await running.next(wait)
                if a is None:
                    if not d.may_hedge():
                        hedging = False  # for good: wait for the attempts already out
                        continue
                    now = d.clock.monotonic()
                    if d.maybe_hedge(running, report=not refused):
                        hedge_at = now + after
                        refused = False
                    else:
                        # Refused: ask again later, backing off (the wait so far doubles),
                        # not every ``after`` for as long as the attempt runs.
                        hedge_at = now + max(after, now - started)
                        refused = True
                    continue
                if isinstance(a.error, LocalOverload):
                    if not running.active and last is None:
                        return d.refused(a)  # the last upstream answer kept, if any, stands
                    # Refused in the sidecar (the pool stayed full) while others of this
                    # sequence ran or failed: it never left and counts for nothing.
                    d.not_sent(a)
                    d.uncount(a)
                    if running.active or last is None:
                        continue
                    a, last = last, None  # the failure kept meanwhile is the one to judge
                else:
                    d.came_back(a)
                    failed = d.failed(a)
                    if failed:
                        d.note_failure(a)
                    if failed and running.active and not d.deadline.expired(a.ended):
                        if last is not None:
                            last.discard()
                        last = a  # the others are this sequence's retries: wait for them
                        continue
                if last is not None and last is not a:
                    last.discard()
                last = None
                decision = d.judged(a)
                if isinstance(decision, Stop):
                    if a.hedge and decision.fate is Fate.SUCCESS:
                        d.events.hedged(HedgeEvent(d.route.name, "won"))
                    answer = a
                    return d.result(decision.fate, a)
                ended = await d.backoff(a, decision)
                if ended is not None:
                    return ended
                d.start(running, hedge=False)
                started = d.clock.monotonic()
                hedge_at = started + after
                refused = False
    except BaseException:
        # The AttemptSet's exit waits for the others to unwind; cancelled there (the client
        # left in that loop turn), the result being returned is dropped, and with it the
        # answer's response, which nothing else owns any more: let it go here.
        if answer is not None:
            answer.discard()
        raise
    finally:
        # A failure kept while others ran, and not the answer: its connection goes back
        # (whatever way this ends -- a winner, the deadline, the client leaving).
        if last is not None:
            last.discard()
        d.ended()

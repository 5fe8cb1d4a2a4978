"""One exchange through a route's whole policy, as a scope that owns what it takes.

``async with Sequence(deps, name, exchange) as seq`` runs breaker admission, the bulkhead wait,
the attempts (with throttle, budgets, kill switch and drain asked between them, hedges racing
slow attempts) and leaves the final upstream response in ``seq.result`` for the body of the
``async with`` to relay. Whatever way the scope is left -- return, exception, cancellation
because the client went away, a timeout -- everything is given back, in this order:

1. every attempt still running (a hedge and its original race as tasks owned by an
   ``AttemptSet`` inside the run: cancelled, their connections closed, their concurrency
   tickets returned, before the run ends);
2. the final upstream response (released if its body was read to the end, else discarded:
   the connection is then closed, never pooled);
3. the bulkhead slot (an ``asyncio.Semaphore`` permit held by ``Bulkhead.slot``);
4. the breaker admission, with exactly ONE verdict for the whole sequence: the upstream's
   answer, or NEUTRAL when the upstream was never asked, the client left, or a local limit
   cut the sequence short (see ``classify.verdict``).

Under a kill switch the sequence is a plain proxy exchange: one attempt, no breaker, no
throttle, no adaptive concurrency limit, no hedge. A sequence that a trusted edge owns (an
inner tier) skips the breaker too: the edge decides for its chain, and inner breakers each
with their own recovery clock only stack up delays after an outage.

Live client traffic (``sidecar.proxy``) and DLQ replays (``sidecar.dlq``) both use it.
"""

from __future__ import annotations

import math
from collections.abc import Coroutine
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from sidecar.config.model import Route
from sidecar.core import Fate, LocalOverload, NoTimeLeft, Verdict
from sidecar.engine.attempter import RouteAttempter
from sidecar.engine.bulkhead import Slot
from sidecar.engine.deps import EngineDeps
from sidecar.engine.gate import SequenceGate
from sidecar.engine.head import edge_head
from sidecar.engine.hedging import hedged
from sidecar.engine.loop import Driver, SequenceResult
from sidecar.engine.sender import AttemptSender, GrpcCall
from sidecar.retry.breaker import Admitted
from sidecar.retry.classify import CUT_SHORT, may_resend, verdict
from sidecar.retry.deadline import Deadline
from sidecar.retry.decide import Constraints
from sidecar.upstream.client import Body, Replay, UpstreamResponse

if TYPE_CHECKING:
    from opentelemetry.trace import Span


@dataclass(init=False)
class Exchange:
    route: Route
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]  # filtered and framed, without per-attempt headers
    body: Body
    chunked: bool
    replayable: bool  # the body is buffered and may be sent again
    edge: bytes | None  # a trusted incoming edge marker
    deadline: Deadline
    idempotency_key: bool
    span: Span | None = None
    upgrade: bool = False  # asks for a protocol switch: sent with Upgrade, a 101 answers it
    # A gRPC call: its own retry rules (gRPC statuses, never the non_idempotent policy), the
    # client's grpc-previous-rpc-attempts, and its request stream, sent as it comes and kept
    # for a retry while it fits (``replay``, else None).
    grpc: GrpcCall | None = None
    replay: Replay | None = None

    # An explicit __init__: mypyc compiles it, where the one @dataclass generates stays
    # interpreted (~3,000 instructions per object made, against ~300). One is made per request.
    def __init__(
        self,
        route: Route,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: Body,
        chunked: bool,
        *,
        replayable: bool,
        edge: bytes | None,
        deadline: Deadline,
        idempotency_key: bool,
        span: Span | None = None,
        upgrade: bool = False,
        grpc: GrpcCall | None = None,
        replay: Replay | None = None,
    ) -> None:
        self.route = route
        self.method = method
        self.target = target
        self.headers = headers
        self.body = body
        self.chunked = chunked
        self.replayable = replayable
        self.edge = edge
        self.deadline = deadline
        self.idempotency_key = idempotency_key
        self.span = span
        self.upgrade = upgrade
        self.grpc = grpc
        self.replay = replay


def shaped(driver: Driver) -> Coroutine[Any, Any, SequenceResult]:
    """The coroutine that runs the sequence, in its shape: one attempt at a time, or hedged
    (attempts racing as tasks in ``engine/hedging.py``, interpreted on purpose: concurrent
    attempts under cancellation). The caller awaits it directly (one coroutine less per request
    than awaiting a wrapper that awaits it)."""
    after = driver.attempter.hedge_after()
    if after is None or not math.isfinite(after) or driver.policy.attempts < 2:
        return driver.one_at_a_time()
    return hedged(driver, after)


class Sequence:
    """The scope of one retry sequence (see the module docstring)."""

    __slots__ = (
        "_deps",
        "_ex",
        "_killed",
        "_name",
        "_period",
        "_probe",
        "_slot",
        "_state",
        "_verdict",
        "refused_for",
        "result",
    )

    def __init__(self, deps: EngineDeps, sidecar_name: bytes, ex: Exchange) -> None:
        self._deps = deps
        self._name = sidecar_name
        self._ex = ex
        self._state = deps.states.get(ex.route.name)
        self._slot: Slot | None = None  # the bulkhead slot held
        self._probe: bool | None = None  # None: not admitted by the breaker (nothing to record)
        self._period = 0
        self._verdict: Verdict | None = None  # an override set while relaying the body
        self._killed = False
        self.result: SequenceResult | None = None  # None when the breaker refused
        self.refused_for = 0.0  # with a refusal: seconds until a sequence would be admitted

    @property
    def response(self) -> UpstreamResponse | None:
        return self.result.response if self.result is not None else None

    def body_failed(self) -> None:
        """The upstream broke while its response body was relayed: the sequence failed."""
        self._verdict = Verdict.FAILURE

    async def __aenter__(self) -> Sequence:
        deps, ex = self._deps, self._ex
        clock = deps.clock
        now = clock.monotonic()
        route = ex.route
        self._killed = deps.kill.covers(route.name, now)
        if not self._killed and ex.edge is None:
            admission = self._state.admit(now)
            if not isinstance(admission, Admitted):
                self.refused_for = admission.retry_after
                return self
            self._probe = admission.probe
            self._period = admission.period
        try:
            self._state.budget.record_request(now)
            self._state.hedge_budget.record_request(now)
            queue_timeout = route.bulkhead.queue_timeout
            wait = min(queue_timeout, ex.deadline.remaining(now))
            try:
                slot = self._state.bulkhead.slot(wait)
                await slot.__aenter__()  # Overloaded without holding anything
                self._slot = slot
            except LocalOverload as exc:
                # Judged by the bound that was set, not by reading the clock again: the loop's
                # timer may fire a little before the clock reaches the deadline.
                if wait < queue_timeout:
                    # The wait was cut by the deadline, not by the queue timeout.
                    spent = NoTimeLeft("the sequence deadline passed waiting for a slot")
                    self.result = SequenceResult(Fate.DEADLINE, 0, None, spent)
                else:
                    self.result = SequenceResult(Fate.OVERLOADED, 0, None, exc)
                return self
            run, attempter = self._start()
            result = self.result = await run
            if ex.span is not None:
                self._annotate(ex.span, attempter, result)
        except BaseException:
            self._close(Verdict.NEUTRAL)
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        result = self.result
        if result is None:
            self._close(None)
            return
        # The sequence ended before the exit: its result is the verdict even when the client
        # left (or a local error happened) while the answer was relayed. Only a sequence the
        # client abandoned before it ended is neutral (``__aenter__`` records that).
        v = self._verdict
        if v is None:
            # "down" matters only for a sequence the budget or the throttle cut short.
            down = result.fate in CUT_SHORT and self._state.throttle.down(
                self._deps.clock.monotonic()
            )
            v = verdict(
                self._ex.route.retry,
                result.response_status,
                result.error,
                result.failed_before,
                result.fate,
                down,
                final_grpc=result.response_grpc,
            )
        self._close(v)

    def _close(self, v: Verdict | None) -> None:
        try:
            up = self.response
            if up is not None:
                up.discard()  # a no-op when the relay released it after the whole body
            slot, self._slot = self._slot, None
            if slot is not None:
                slot.release()
        finally:
            if self._probe is not None:
                clock = self._deps.clock
                self._state.breaker.record(
                    clock.monotonic(),
                    v or Verdict.NEUTRAL,
                    self._probe,
                    clock.wall(),
                    self._period,
                )
                self._probe = None

    def _start(self) -> tuple[Coroutine[Any, Any, SequenceResult], RouteAttempter]:
        """The attempts' coroutine, awaited by ``__aenter__`` itself (a coroutine that awaited
        it would cost one more frame per request), and the attempter it uses."""
        deps, ex = self._deps, self._ex
        route = ex.route
        clock = deps.clock
        # A trusted incoming marker is passed on unchanged; otherwise this sidecar is the edge.
        edge_value = ex.edge if ex.edge is not None and ex.edge != b"tracestate" else self._name
        sender = AttemptSender(
            deps.client,
            clock,
            deps.tracing,
            ex.span,
            ex.method,
            edge_head(
                ex.method,
                ex.target,
                ex.headers,
                edge_value,
                # a traceparent of ours goes with each attempt (OTEL_PROPAGATORS has it)
                traced=ex.span is not None and deps.tracing.w3c,
            ),
            body=ex.body,
            chunked=ex.chunked,
            deadline=ex.deadline,
            upgrade=ex.upgrade,
            target=ex.target,
            tls=deps.client.tls.get(route.tls) if self._state.tls_hosts else None,
            tls_hosts=self._state.tls_hosts,
            protocol=route.upstream_protocol,
            grpc=ex.grpc,
            replay=ex.replay,
        )
        method = ex.method
        killed = self._killed
        gate = SequenceGate(route.name, self._state, deps.kill, deps.life, clock, deps.rng)
        constraints = Constraints(
            # A gRPC call follows gRPC's rules: retried on the statuses listed.
            may_resend=ex.grpc is not None or may_resend(route.retry, method, ex.idempotency_key),
            body_replayable=ex.replayable,
            edge_owned=ex.edge is not None,
            killed=killed,
            once=ex.upgrade,
        )
        # Hedged: on a route that turns it on, a method it hedges (GET, HEAD, OPTIONS unless it
        # lists more), never a request with an Idempotency-Key (two copies of it in flight at
        # once are what such a server refuses), a buffered body, nobody owning retries but this
        # sidecar, and the adaptive per-try timeout.
        hedgeable = (
            route.hedge.enabled
            and route.retry.per_try_timeout is None
            and method in route.hedge.methods
            and (method != "POST" or ex.grpc is not None)  # POST listed: gRPC calls only
            and not ex.idempotency_key
            and ex.replayable
            and ex.edge is None
            and not killed
        )
        attempter = RouteAttempter(
            route, self._state, sender.send, clock, deps.events, hedgeable, adaptive=not killed
        )
        driver = Driver(
            route,
            attempter,
            ex.deadline,
            constraints,
            clock,
            deps.rng,
            events=deps.events,
            gate=gate,
            replay=ex.replay,
        )
        return shaped(driver), attempter

    def _annotate(self, span: Span, attempter: RouteAttempter, result: SequenceResult) -> None:
        per_try = self._ex.route.retry.per_try_timeout
        auto = attempter.hedge_after() if per_try is None else None
        if per_try is not None or auto is not None:
            span.set_attribute("retry_sidecar.per_try_timeout", per_try or auto or 0.0)
        if result.hedges:
            span.set_attribute("retry_sidecar.hedges", result.hedges)

"""Per-route runtime state (breaker, budgets, throttle, concurrency limit, latency, endpoints,
bulkhead), kept by route NAME so that it survives a config reload; ``sync`` hands each one the
new policy."""

from __future__ import annotations

from collections.abc import Callable

from sidecar.config.model import BudgetPolicy, Config, HedgePolicy, Route
from sidecar.engine.bulkhead import Bulkhead
from sidecar.retry.breaker import Admission, Breaker, Rejected, State
from sidecar.retry.budget import Budget
from sidecar.retry.concurrency import AdaptiveLimit
from sidecar.retry.endpoints import EndpointSet
from sidecar.retry.latency import AttemptLatency
from sidecar.retry.throttle import Throttle

TransitionHook = Callable[[str, State, State], None]
LATENCY_WINDOW = 10.0  # seconds of attempt latencies behind ``per_try_timeout: auto``


def hedge_budget_policy(h: HedgePolicy) -> BudgetPolicy:
    return BudgetPolicy(ratio=h.ratio, min_per_second=h.min_per_second, window=h.window)


def tls_hosts(route: Route) -> dict[str, str]:
    """The URL host of each ``https://`` upstream by its authority (an endpoint's name): the
    name its connections send as SNI and verify, whatever address it resolves to."""
    return {u.authority: u.host for u in route.upstreams if u.tls}


def configured_endpoints(route: Route) -> list[tuple[str, int, str]]:
    """The route's endpoints as written (host names not resolved yet)."""
    return [(u.host, u.port, u.authority) for u in route.upstreams]


class RouteState:
    __slots__ = (
        "breaker",
        "budget",
        "bulkhead",
        "endpoints",
        "hedge_budget",
        "latency",
        "limiter",
        "name",
        "throttle",
        "tls_hosts",
        "upstreams",
    )

    def __init__(self, route: Route, hook: TransitionHook | None) -> None:
        self.name = route.name
        on_transition = None
        if hook is not None:
            name = route.name

            def on_transition(frm: State, to: State) -> None:
                hook(name, frm, to)

        self.breaker = Breaker(route.breaker, on_transition)
        self.budget = Budget(route.budget)
        self.hedge_budget = Budget(hedge_budget_policy(route.hedge))
        self.throttle = Throttle(route.throttle)
        self.limiter = AdaptiveLimit(route.bulkhead)
        self.latency = AttemptLatency(LATENCY_WINDOW)
        self.bulkhead = Bulkhead(route.bulkhead)
        self.upstreams = route.upstreams
        self.tls_hosts = tls_hosts(route)
        self.endpoints = EndpointSet(configured_endpoints(route))

    def admit(self, now: float) -> Admission:
        """The breaker's admission of a sequence. One it refuses counts for the throttle as a
        request the upstream did not accept, as the SRE book's client-side throttling counts
        the requests it rejects itself: while the breaker is open the throttle's window keeps
        saying "down" instead of emptying, so that a half-open ramp starts with retries
        refused rather than allowed (until ``min_requests`` fresh attempts)."""
        admission = self.breaker.admit(now)
        if isinstance(admission, Rejected):
            self.throttle.record(now, accepted=False)
        return admission

    def update(self, route: Route) -> None:
        self.breaker.update_policy(route.breaker)
        self.budget.update_policy(route.budget)
        self.hedge_budget.update_policy(hedge_budget_policy(route.hedge))
        self.throttle.update_policy(route.throttle)
        self.limiter.update_policy(route.bulkhead)
        self.bulkhead.update_policy(route.bulkhead)
        if route.upstreams != self.upstreams:
            # Other endpoints: as written until the resolver has looked the names up.
            self.upstreams = route.upstreams
            self.tls_hosts = tls_hosts(route)
            self.endpoints.update(configured_endpoints(route))


class RouteStates:
    def __init__(self, hook: TransitionHook | None = None) -> None:
        self._by_name: dict[str, RouteState] = {}
        self._hook = hook

    def sync(self, config: Config) -> None:
        """Create state for new routes, update policies of kept ones. State of routes that
        disappeared is kept too, so a route removed and re-added by mistake keeps its breaker."""
        for route in config.routes:
            st = self._by_name.get(route.name)
            if st is None:
                self._by_name[route.name] = RouteState(route, self._hook)
            else:
                st.update(route)

    def get(self, name: str) -> RouteState:
        return self._by_name[name]

    def items(self) -> list[tuple[str, RouteState]]:
        return list(self._by_name.items())

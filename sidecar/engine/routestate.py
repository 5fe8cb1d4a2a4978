"""Per-route runtime state (breaker, budget, bulkhead), kept by route NAME so that it survives
a config reload; ``sync`` hands each one the new policy."""

from __future__ import annotations

from collections.abc import Callable

from sidecar.config.model import Config, Route
from sidecar.engine.bulkhead import Bulkhead
from sidecar.retry.breaker import Breaker, State
from sidecar.retry.budget import Budget

TransitionHook = Callable[[str, State, State], None]


class RouteState:
    __slots__ = ("breaker", "budget", "bulkhead", "name")

    def __init__(self, route: Route, hook: TransitionHook | None) -> None:
        self.name = route.name
        on_transition = None
        if hook is not None:
            name = route.name

            def on_transition(frm: State, to: State) -> None:
                hook(name, frm, to)

        self.breaker = Breaker(route.breaker, on_transition)
        self.budget = Budget(route.budget)
        self.bulkhead = Bulkhead(route.bulkhead)

    def update(self, route: Route) -> None:
        self.breaker.update_policy(route.breaker)
        self.budget.update_policy(route.budget)
        self.bulkhead.update_policy(route.bulkhead)


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

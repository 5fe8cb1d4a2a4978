"""``retry-sidecar explain``: what a policy can cost, before it is rolled out."""

from __future__ import annotations

from sidecar.config.model import Config, Route
from sidecar.config.units import format_duration
from sidecar.retry.worstcase import budget_multiplier, stacked, worst_case

RATES = (100.0, 1000.0)


def explain_route(route: Route) -> list[str]:
    p = route.retry
    wc = worst_case(route)
    b = route.budget
    lines = [
        f"route {route.name} -> {route.upstream}",
        f"  policy: attempts {p.attempts}, per-try {format_duration(p.per_try_timeout)}, "
        f"deadline {format_duration(route.timeout)}, backoff {p.backoff.strategy} "
        f"{format_duration(p.backoff.base)}..{format_duration(p.backoff.max)}"
        + (
            f", Retry-After honoured up to {format_duration(p.retry_after.max)}"
            if p.retry_after.honor
            else ""
        ),
        f"  worst-case attempts per request:  {wc.attempts}",
        f"  worst-case wall clock:            {wc.wall_clock:.3f}s "
        f"(every attempt slow, every wait at its longest; ends as '{wc.wall_clock_fate.value}')",
    ]
    with_budget = [budget_multiplier(route, wc.attempts, r) for r in RATES]
    lines.append(
        f"  upstream load in a full outage:   x{wc.attempts:.2f} without budget; with budget "
        f"(ratio {b.ratio:g}, floor {b.min_per_second:g}/s over {format_duration(b.window)}): "
        + ", ".join(f"x{m:.2f} at {r:g} req/s" for m, r in zip(with_budget, RATES, strict=True))
    )
    m = with_budget[0]
    lines.append(
        "  stacked over tiers, calls at the bottom per client request (budget at 100 req/s):"
    )
    lines.append(f"    {'':<22}{'1 tier':>10}{'2 tiers':>10}{'3 tiers':>10}")
    rows = [
        ("naive", wc.attempts, False),
        ("naive + budget", m, False),
        ("edge-only", wc.attempts, True),
        ("edge-only + budget", m, True),
    ]
    for label, per_tier, edge in rows:
        cells = "".join(f"{'x' + format(stacked(per_tier, n, edge), '.2f'):>10}" for n in (1, 2, 3))
        lines.append(f"    {label:<22}{cells}")
    return lines


def explain(config: Config) -> str:
    n = len(config.routes)
    out = [f"{config.source}: {n} route{'s' if n != 1 else ''}"]
    for route in config.routes:
        out.append("")
        out.extend(explain_route(route))
    return "\n".join(out)

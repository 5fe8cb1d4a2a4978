"""``retry-sidecar explain``: what a policy can cost, before it is rolled out."""

from __future__ import annotations

from dataclasses import replace

from sidecar.config.idempotency import guarded_methods
from sidecar.config.model import Config, Route
from sidecar.config.render import setting
from sidecar.retry.worstcase import budget_multiplier, stacked, worst_case

RATES = (100.0, 1000.0)


def _per_try(route: Route) -> str:
    p = route.retry
    if p.per_try_timeout is not None:
        return f"per-try {setting(p, 'per_try_timeout')} (an attempt is abandoned then)"
    a = p.auto_timeout
    return (
        f"per-try auto ({setting(a, 'multiplier')} x p{a.percentile * 100:g} of recent attempts, "
        f"{setting(a, 'min')}..{setting(a, 'max')}; never abandoned)"
    )


def _storm_lines(route: Route) -> list[str]:
    """One line per storm-control mechanism, with what it does at its settings."""
    b, t, h, br, bh = route.budget, route.throttle, route.hedge, route.breaker, route.bulkhead
    p = route.retry
    lines = []
    retries_100 = min(p.attempts - 1, b.ratio + b.min_per_second / 100.0)
    lines.append(
        f"  retry budget: ratio {setting(b, 'ratio')} + {setting(b, 'min_per_second')}/s over "
        f"{setting(b, 'window')}: at 100 req/s at most {retries_100:.2f} retries per request "
        f"on average (attempts {p.attempts} alone would allow {p.attempts - 1}, as nginx's "
        f"{p.attempts} tries do)"
    )
    if t.enabled:
        lines.append(
            f"  adaptive throttle: retries and hedges refused with p = (attempts - "
            f"{setting(t, 'k')} x accepted) / (attempts + 1) over {setting(t, 'window')} (from "
            f"{setting(t, 'min_requests')} attempts): none while >= {100 / t.k:.0f}% are accepted, "
            f"{max(0.0, 1 - t.k * 0.4):.0%} at 60% failing, all once 5% or fewer are; "
            f"first attempts are never throttled"
        )
    else:
        lines.append("  adaptive throttle: off")
    hedged = h.enabled and p.per_try_timeout is None and p.attempts > 1
    if hedged:
        methods = ", ".join(sorted(h.methods))
        lines.append(
            f"  hedging: on for {methods} (never with an Idempotency-Key): a request "
            f"unanswered after the per-try timeout is raced by another attempt (another "
            f"endpoint first); budget ratio {setting(h, 'ratio')} + "
            f"{setting(h, 'min_per_second')}/s over {setting(h, 'window')}"
        )
    elif not h.enabled:
        lines.append("  hedging: off (opt-in per route: hedge: {enabled: true})")
    else:
        lines.append("  hedging: off (needs per_try_timeout: auto and attempts >= 2)")
    if br.enabled:
        lines.append(
            f"  breaker: opens when >= {setting(br, 'failure_ratio')} of >= "
            f"{setting(br, 'min_sequences')} sequences in {setting(br, 'window')} failed after "
            f"their whole policy; open "
            f"{setting(br, 'open_for')}, doubled on each reopen up to "
            f"{setting(br, 'max_open_for')}; half-open ramps traffic back over "
            f"{setting(br, 'ramp')} (judging >= {setting(br, 'half_open_probes')} sequences)"
        )
    else:
        lines.append("  breaker: off")
    if bh.adaptive:
        lines.append(
            f"  concurrency: adaptive, {setting(bh, 'min_concurrent')}.."
            f"{setting(bh, 'max_concurrent')} upstream attempts in flight following latency "
            f"(over it: 503 at once); bulkhead "
            f"{setting(bh, 'max_concurrent')} sequences, queue {setting(bh, 'queue_timeout')}"
        )
    else:
        lines.append(
            f"  concurrency: fixed bulkhead of {setting(bh, 'max_concurrent')} sequences, queue "
            f"{setting(bh, 'queue_timeout')} (adaptive limit: opt-in per route, "
            "bulkhead: {adaptive: true})"
        )
    eps = ", ".join(u.authority for u in route.upstreams)
    lines.append(
        f"  endpoints: {eps} (host names: every address, re-resolved; retries and hedges "
        f"prefer another endpoint)"
    )
    lines.append("  kill switch: one attempt through the same path, none of the above")
    lines.append(_idempotency_line(route))
    return lines


def _idempotency_line(route: Route) -> str:
    """What the route does with an Idempotency-Key."""
    idem = route.idempotency
    if not idem.enabled:
        return "  idempotency: off (the key is forwarded; idempotency: {enabled: true} enforces it)"
    guarded = guarded_methods(idem, route.match.methods)
    if not guarded:
        return (
            "  idempotency: enabled, but guards nothing: the route matches only "
            f"{', '.join(sorted(route.match.methods or ()))}, none of "
            f"{'/'.join(sorted(idem.methods))} (the key is forwarded)"
        )
    # The lease in force (null: the route's timeout + 5 s), written as the file writes it.
    lease = setting(replace(idem, lease=idem.lease_for(route.timeout)), "lease")
    scope = f", scoped by {idem.scope_header}" if idem.scope_header else ""
    return (
        f"  idempotency: {'/'.join(sorted(guarded))} with an Idempotency-Key reach the app "
        f"once{scope}; the answer kept {setting(idem, 'ttl')} (up to "
        f"{idem.max_response_bytes} bytes) and replayed; a duplicate in progress gets 409, "
        f"another request under the key 422, "
        + ("no key 400" if idem.required else "no key passes unguarded")
        + f"; a dead sidecar's key is taken over after {lease} (the write "
        f"may then run twice); store unreachable: {idem.on_store_error}; bodies buffered up to "
        f"{route.retry.max_body_bytes} bytes (larger: 413)"
    )


def _tls_line(route: Route) -> str | None:
    """What the route's https:// upstreams are verified against, and what it presents."""
    names = sorted({route.tls.server_name or u.host for u in route.upstreams if u.tls})
    if not names:
        return None
    t = route.tls
    if not t.verify:
        line = (
            f"  tls: NOT VERIFIED (verify: false): any certificate is taken for "
            f"{', '.join(names)}; TLS {t.min_version}+"
        )
    else:
        store = t.ca_file if t.ca_file is not None else "the system's trust store"
        line = (
            f"  tls: chain verified against {store}, name {', '.join(names)} (SNI and "
            f"certificate); TLS {t.min_version}+"
        )
    if t.client_cert is not None:
        line += f"; client certificate {t.client_cert} (mutual TLS)"
    return line


def explain_route(route: Route) -> list[str]:
    p = route.retry
    wc = worst_case(route)
    b = route.budget
    lines = [
        f"route {route.name} -> {', '.join(str(u) for u in route.upstreams)}",
        f"  policy: attempts {p.attempts}, {_per_try(route)}, "
        f"deadline {setting(route, 'timeout')}, backoff {setting(p.backoff, 'strategy')} "
        f"{setting(p.backoff, 'base')}..{setting(p.backoff, 'max')}"
        + (
            f", Retry-After honoured up to {setting(p.retry_after, 'max')}"
            if p.retry_after.honor
            else ""
        ),
        f"  worst-case attempts per request:  {wc.attempts}",
        f"  worst-case wall clock:            {wc.wall_clock:.3f}s "
        f"(every attempt slow, every wait at its longest; ends as '{wc.wall_clock_fate.value}')",
    ]
    tls = _tls_line(route)
    if tls is not None:
        lines.append(tls)
    lines.extend(_storm_lines(route))
    with_budget = [budget_multiplier(route, wc.attempts, r) for r in RATES]
    steady = "x1.00 once the throttle has seen it" if route.throttle.enabled else ""
    lines.append(
        f"  upstream load in a full outage:   x{wc.attempts:.2f} without budget; with budget "
        f"(ratio {setting(b, 'ratio')}, floor {setting(b, 'min_per_second')}/s over "
        f"{setting(b, 'window')}): "
        + ", ".join(f"x{m:.2f} at {r:g} req/s" for m, r in zip(with_budget, RATES, strict=True))
        + (f"; {steady}" if steady else "")
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

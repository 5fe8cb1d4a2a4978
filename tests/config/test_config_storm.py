"""Configuration of storm control: defaults, several upstreams, ``auto``, and the errors, each
naming its line and key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from sidecar.config.errors import ConfigError
from sidecar.config.model import (
    AutoTimeout,
    BreakerPolicy,
    BudgetPolicy,
    BulkheadPolicy,
    HedgePolicy,
    ThrottlePolicy,
    Upstream,
)
from sidecar.config.parse import parse_file, parse_text

ROOT = Path(__file__).resolve().parents[2]
MINIMAL = "version: 1\nroutes:\n  - name: a\n    upstream: http://127.0.0.1:1\n"


def errors_of(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_text(text, "c.yaml")
    return info.value.lines()


def test_shipped_defaults():
    r = parse_text(MINIMAL).routes[0]
    assert r.timeout == 60.0
    assert r.retry.per_try_timeout is None  # auto
    assert r.retry.auto_timeout == AutoTimeout(0.95, 2.0, 0.05, 10.0)
    assert r.stream_idle_timeout == 60.0
    assert r.breaker == BreakerPolicy(
        enabled=True,
        failure_ratio=0.95,
        min_sequences=20,
        window=10.0,
        open_for=1.0,
        max_open_for=30.0,
        half_open_probes=3,
        ramp=1.0,
    )
    assert r.budget == BudgetPolicy(0.5, 10.0, 10.0)
    assert r.throttle == ThrottlePolicy(True, 2.0, 1.0, 10)
    # Hedging is opt-in: with shipped defaults no request is duplicated while in progress.
    assert r.hedge == HedgePolicy(False, frozenset({"GET", "HEAD", "OPTIONS"}), 0.1, 1.0, 10.0)
    assert r.bulkhead == BulkheadPolicy(1000, 1.0, False, 5)  # adaptive: opt-in


def test_the_example_file_shows_every_default():
    example = parse_file(str(ROOT / "config" / "sidecar.yaml"))
    shipped = parse_text(MINIMAL).routes[0]
    r = example.route("default")
    assert r is not None
    for section in ("timeout", "retry", "breaker", "budget", "throttle", "hedge", "bulkhead"):
        assert getattr(r, section) == getattr(shipped, section), section
    assert example.upstream_pool == parse_text(MINIMAL).upstream_pool


def test_several_upstreams():
    c = parse_text(
        "version: 1\nroutes:\n  - name: a\n"
        '    upstream: ["http://10.0.0.1:80", "http://[::1]:8080", "http://svc.local"]\n'
    )
    r = c.routes[0]
    assert r.upstreams == (
        Upstream("10.0.0.1", 80),
        Upstream("::1", 8080),
        Upstream("svc.local", 80),
    )
    assert r.upstream == Upstream("10.0.0.1", 80)


@pytest.mark.parametrize(
    ("snippet", "line"),
    [
        ("upstream: []", "routes[0].upstream: expected at least one upstream URL"),
        (
            'upstream: ["http://a:1", "http://a:1"]',
            "routes[0].upstream: item 1: http://a:1 is listed twice",
        ),
        (
            'upstream: ["http://a:1", "ftp://b"]',
            "routes[0].upstream: item 1: expected an http:// or https:// URL",
        ),
    ],
)
def test_upstream_list_errors(snippet, line):
    lines = errors_of(f"version: 1\nroutes:\n  - name: a\n    {snippet}\n")
    assert any(x.startswith(f"c.yaml:4: {line}") for x in lines), lines


@pytest.mark.parametrize(
    ("snippet", "path", "fragment"),
    [
        ("retry: {per_try_timeout: soon}", "routes[0].retry.per_try_timeout", "(or auto)"),
        ("retry: {per_try_timeout: 0s}", "routes[0].retry.per_try_timeout", "greater than 0"),
        (
            "retry: {auto_timeout: {percentile: 1}}",
            "routes[0].retry.auto_timeout.percentile",
            "between 0 and 1",
        ),
        (
            "retry: {auto_timeout: {min: 2s, max: 1s}}",
            "routes[0].retry.auto_timeout.max",
            "at least min",
        ),
        (
            "retry: {auto_timeout: {multiplier: 0.5}}",
            "routes[0].retry.auto_timeout.multiplier",
            "at least 1",
        ),
        (
            "breaker: {open_for: 5s, max_open_for: 2s}",
            "routes[0].breaker.max_open_for",
            "at least open_for",
        ),
        ("breaker: {ramp: fast}", "routes[0].breaker.ramp", "duration"),
        ("breaker: {enabled: 1}", "routes[0].breaker.enabled", "true or false"),
        ("throttle: {k: 0.5}", "routes[0].throttle.k", "at least 1"),
        ("throttle: {window: 0s}", "routes[0].throttle.window", "greater than 0"),
        ("throttle: {aggression: 2}", "routes[0].throttle.aggression", "unknown key"),
        ("hedge: {ratio: -1}", "routes[0].hedge.ratio", "negative"),
        ("hedge: {delay: 10ms}", "routes[0].hedge.delay", "unknown key"),
        ("hedge: {methods: [GET, PATCH]}", "routes[0].hedge.methods", "PATCH is not idempotent"),
        ("hedge: {methods: [PATCH]}", "routes[0].hedge.methods", "PATCH is not idempotent"),
        ("hedge: {methods: []}", "routes[0].hedge.methods", "non-empty list"),
        (
            "bulkhead: {max_concurrent: 10, min_concurrent: 20}",
            "routes[0].bulkhead.min_concurrent",
            "must not exceed max_concurrent (10)",
        ),
        ("bulkhead: {adaptive: yes please}", "routes[0].bulkhead.adaptive", "true or false"),
    ],
)
def test_storm_control_mistakes_name_line_and_path(snippet, path, fragment):
    lines = errors_of(
        f"version: 1\nroutes:\n  - name: a\n    upstream: http://h:1\n    {snippet}\n"
    )
    assert any(x.startswith(f"c.yaml:5: {path}: ") and fragment in x for x in lines), lines


def test_an_open_for_above_the_inherited_maximum_raises_the_maximum():
    r = parse_text(MINIMAL + "    breaker: {open_for: 60s}\n").routes[0]
    assert (r.breaker.open_for, r.breaker.max_open_for) == (60.0, 60.0)


def test_an_inherited_min_concurrent_is_clamped_to_a_smaller_max():
    r = parse_text(MINIMAL + "    bulkhead: {max_concurrent: 2}\n").routes[0]
    assert (r.bulkhead.min_concurrent, r.bulkhead.max_concurrent) == (2, 2)


def test_a_route_turns_hedging_on_and_lists_what_it_hedges():
    r = parse_text(MINIMAL + "    hedge: {enabled: true, methods: [GET, PUT, DELETE]}\n").routes[0]
    assert r.hedge.enabled and r.hedge.methods == {"GET", "PUT", "DELETE"}
    # Listing methods alone does not turn it on: the opt-in is ``enabled``.
    r = parse_text(MINIMAL + "    hedge: {methods: [GET, PUT]}\n").routes[0]
    assert not r.hedge.enabled


def test_every_mechanism_can_be_switched_off_per_route():
    r = parse_text(
        MINIMAL + "    breaker: {enabled: false}\n    throttle: {enabled: false}\n"
        "    hedge: {enabled: false}\n    bulkhead: {adaptive: false}\n"
        "    retry: {per_try_timeout: 2s}\n"
    ).routes[0]
    assert not (r.breaker.enabled or r.throttle.enabled or r.hedge.enabled)
    assert not r.bulkhead.adaptive and r.retry.per_try_timeout == 2.0


def test_dns_refresh():
    c = parse_text("version: 1\nupstream_pool: {dns_refresh: 30s}\n" + MINIMAL.split("\n", 1)[1])
    assert c.upstream_pool.dns_refresh == 30.0
    lines = errors_of("version: 1\nupstream_pool: {dns_refresh: 0s}\n" + MINIMAL.split("\n", 1)[1])
    assert any("upstream_pool.dns_refresh: must be greater than 0" in x for x in lines)


def test_max_request_body_is_unlimited_by_default_and_takes_a_size_or_unlimited():
    from sidecar.config.units import MAX_SIZE

    assert parse_text(MINIMAL).limits.max_request_body == MAX_SIZE
    top = MINIMAL.split("\n", 1)[1]
    c = parse_text("version: 1\nlimits: {max_request_body: 8MiB}\n" + top)
    assert c.limits.max_request_body == 8 * 1024 * 1024
    c = parse_text("version: 1\nlimits: {max_request_body: unlimited}\n" + top)
    assert c.limits.max_request_body == MAX_SIZE
    with pytest.raises(ConfigError, match=r"limits\.max_request_body.*or 'unlimited'"):
        parse_text("version: 1\nlimits: {max_request_body: lots}\n" + top)

"""What validate accepts, a running sidecar can apply and use: hypothesis writes configs over
every key of the file (edge values and junk alike); each one either is refused with a line and
a key path, or is applied to a running set of state (and back again) and then used the ways a
running process uses a config -- the status page, /config, /killswitch, the metrics, explain,
and the per-route arithmetic of a sequence (backoff, budgets, breaker, throttle, limits)."""

from __future__ import annotations

import asyncio
import json
import random
from datetime import timedelta
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sidecar.admin.killswitch import iso
from sidecar.admin.render import View, status_page
from sidecar.admin.server import route_json
from sidecar.admin.snapshot import take
from sidecar.app import Sidecar
from sidecar.config.errors import ConfigError
from sidecar.config.model import Config
from sidecar.config.parse import parse_text
from sidecar.config.watch import needs_restart
from sidecar.explain import explain
from sidecar.retry.backoff import delay

BASE = 'version: 1\nroutes: [{name: a, upstream: "http://127.0.0.1:9"}]\n'


def kind(valid: list[Any], invalid: list[Any]) -> st.SearchStrategy[Any]:
    """Mostly values validate accepts (edges included), now and then one it must refuse."""
    return st.integers(0, 99).flatmap(
        lambda i: st.sampled_from(invalid) if i == 0 else st.sampled_from(valid)
    )


DURATIONS = kind(
    ["0ms", "1ms", "250ms", "2s", "5m", "1h", "0.0000000001ms", "315576000000s", "87660000h"],
    ["315576000001s", "1e3s", "-1s", "10", ""],
)
POSITIVE = kind(
    ["1ms", "250ms", "2s", "5m", "1h", "0.0000000001ms", "315576000000s", "87660000h"],
    ["0ms"],
)
SIZES = kind([0, 1, 512, "64KiB", "1GiB", 2**63 - 1, "9223372036854775807"], [2**63, -1])
RATIOS = kind([5e-324, 1e-300, 0.5, 0.95, 1], [0, 2])
NUMBERS = kind([0, 0.0, 5e-324, 1e-300, 0.5, 0.95, 1, 2.5, 1e9], [1e9 + 1, -1, True])
FACTORS = kind([1, 1.0000001, 2.5, 1e9], [0.5, 1e9 + 1])
RATES = kind([5e-324, 1e-300, 0.5, 1, 1e9], [0, -1])
INTS = kind([1, 2, 3, 10, 1000], [0, -1, 2**63, True])
BIG_INTS = kind([1, 2, 1000, 100_000, 1_000_000], [0, 1_000_001])
MIN_REQUESTS = kind([0, 1, 10, 1_000_000], [-1])
BOOLS = kind([True, False], ["yes", 1])
JUNK = st.one_of(st.none(), st.text(max_size=5), st.lists(st.integers(), max_size=2))


@st.composite
def instants(draw: st.DrawFn) -> str:
    """RFC 3339 times, most of them at the ends of what a datetime holds, any offset."""
    date = draw(st.sampled_from(["0001-01-01", "9999-12-31", "1970-01-01", "2099-06-30"]))
    clock = draw(st.sampled_from(["00:00:00", "23:59:59", "12:00:00"]))
    frac = draw(st.sampled_from(["", ".5", ".999999", ".9999999"]))
    minutes = draw(st.one_of(st.sampled_from([0, 1, 1439]), st.integers(0, 1439)))
    sign = draw(st.sampled_from("+-"))
    zone = draw(st.sampled_from(["Z", f"{sign}{minutes // 60:02d}:{minutes % 60:02d}"]))
    return f"{date}T{clock}{frac}{zone}"


# Every key of the file, by the kind of value it takes. A section's keys are written in
# ``defaults`` and in the route (routes override them section by section).
ROUTE_KEYS: dict[str, st.SearchStrategy[Any]] = {
    "timeout": POSITIVE,
    "stream_idle_timeout": POSITIVE,
    "retry.attempts": kind([1, 2, 3, 10], [0, 11]),
    "retry.per_try_timeout": st.one_of(POSITIVE, st.just("auto")),
    "retry.auto_timeout.percentile": kind([5e-324, 0.5, 0.95, 0.9999999], [0, 1]),
    "retry.auto_timeout.multiplier": FACTORS,
    "retry.auto_timeout.min": POSITIVE,
    "retry.auto_timeout.max": POSITIVE,
    "retry.backoff.strategy": kind(
        ["full_jitter", "equal_jitter", "decorrelated_jitter", "exponential", "constant"], ["x"]
    ),
    "retry.backoff.base": DURATIONS,
    "retry.backoff.max": DURATIONS,
    "retry.retry_on": st.lists(
        kind(
            ["connect-failure", "reset", "per-try-timeout", 503, "5xx", 429, "unavailable"],
            [200, "ok"],
        ),
        max_size=3,
    ),
    "retry.retry_after.honor": BOOLS,
    "retry.retry_after.max": POSITIVE,
    "retry.non_idempotent": kind(["never", "with-idempotency-key", "always"], ["x"]),
    "retry.max_body_bytes": SIZES,
    "breaker.enabled": BOOLS,
    "breaker.failure_ratio": RATIOS,
    "breaker.min_sequences": BIG_INTS,
    "breaker.window": POSITIVE,
    "breaker.open_for": POSITIVE,
    "breaker.max_open_for": POSITIVE,
    "breaker.half_open_probes": INTS,
    "breaker.ramp": DURATIONS,
    "budget.ratio": NUMBERS,
    "budget.min_per_second": NUMBERS,
    "budget.window": POSITIVE,
    "bulkhead.max_concurrent": BIG_INTS,
    "bulkhead.queue_timeout": DURATIONS,
    "bulkhead.adaptive": BOOLS,
    "bulkhead.min_concurrent": BIG_INTS,
    "throttle.enabled": BOOLS,
    "throttle.k": FACTORS,
    "throttle.window": POSITIVE,
    "throttle.min_requests": MIN_REQUESTS,
    "hedge.enabled": BOOLS,
    "hedge.ratio": NUMBERS,
    "hedge.min_per_second": NUMBERS,
    "hedge.window": POSITIVE,
    "hedge.methods": st.lists(
        kind(["GET", "HEAD", "PUT", "DELETE"], ["POST", "BREW", "head"]), max_size=3
    ),
    "upgrade.enabled": BOOLS,
    "upgrade.idle_timeout": POSITIVE,
    "dlq.enabled": st.just(False),  # True opens a DLQ file: covered by the DLQ's own tests
    "dlq.respond": kind(["passthrough", "accepted"], ["x"]),
    "dlq.keep_credentials": BOOLS,
    "dlq.max_replays": INTS,
    "dlq.replay_rate": RATES,
    "dlq.redrive.enabled": BOOLS,
    "dlq.redrive.interval": POSITIVE,
    "dlq.drop_headers": st.lists(kind(["x-a", "Cookie"], ["bad header"]), max_size=2),
    "idempotency.enabled": BOOLS,
    "idempotency.methods": st.lists(kind(["POST", "PATCH", "PUT"], ["BREW", "patch"]), max_size=2),
    "idempotency.required": BOOLS,
    "idempotency.ttl": POSITIVE,
    "idempotency.lease": st.one_of(st.none(), POSITIVE),
    "idempotency.max_response_bytes": SIZES,
    "idempotency.scope_header": kind([None, "Authorization", "x-tenant"], ["two words", 3]),
    "idempotency.on_store_error": kind(["refuse", "pass"], ["drop"]),
    # a file that parses is the TLS tests' (tests/config/test_tls_config.py): here, none or gone
    "tls.ca_file": kind([None], ["/nonexistent/ca.pem", ""]),
    "tls.server_name": kind([None, "api.example.com"], ["", 3]),
    "tls.client_cert": kind([None], ["/nonexistent/client.pem"]),
    "tls.client_key": kind([None], ["/nonexistent/client.key"]),
    "tls.verify": BOOLS,
    "forward_client_cert": BOOLS,
    "upstream_protocol": kind(["http1", "h2", "auto"], ["http2", "h2c", True]),
    "tls.min_version": kind(["1.2", "1.3"], ["1.1", 1.2]),
}
TOP_KEYS: dict[str, st.SearchStrategy[Any]] = {
    "name": kind(["edge", "x" * 128, "~"], ["", "é", "x" * 129]),
    "listen": kind(["127.0.0.1:0", "[::1]:0", "localhost:65535"], ["h:1", ":1"]),
    "admin.listen": kind(["127.0.0.1:0", "[::1]:65535"], ["127.0.0.1:65536"]),
    "admin.token_env": kind(["TOKEN", None], ["1x"]),
    "admin.allowed_hosts": st.lists(kind(["sidecar.local", "admin.svc"], ["a b"]), max_size=2),
    "trusted_peers": st.lists(kind(["10.0.0.0/8", "::1/128", "0.0.0.0/0"], ["nope"]), max_size=2),
    "dlq.backend": kind(["sqlite", "redis"], ["memcached"]),
    "dlq.path": kind(["/nonexistent/dlq.sqlite3"], [""]),
    "dlq.max_records": kind([1, 100_000_000], [0]),
    "dlq.max_bytes": SIZES,
    "idempotency.backend": kind(["sqlite", "redis"], ["memcached"]),
    "idempotency.path": kind(["/nonexistent/idempotency.sqlite3"], [""]),
    "idempotency.max_records": kind([1, 1_000_000_000], [0]),
    "idempotency.max_bytes": SIZES,
    "limits.max_header_bytes": SIZES,
    "limits.header_timeout": POSITIVE,
    "limits.body_idle_timeout": POSITIVE,
    "limits.keepalive_timeout": POSITIVE,
    "limits.max_request_body": kind([0, 512, "1MiB", "unlimited", 2**63 - 1], [2**63, -1, "none"]),
    "limits.send_timeout": POSITIVE,
    "http2.max_concurrent_streams": kind([1, 100, 10_000], [0, 10_001, "many", True]),
    "telemetry.access_log": BOOLS,
    "server_tls.cert_file": kind([None], ["/nonexistent/cert.pem"]),
    "server_tls.key_file": kind([None], ["/nonexistent/key.pem"]),
    "server_tls.client_ca_file": kind([None], ["/nonexistent/ca.pem"]),
    "server_tls.min_version": kind(["1.2", "1.3"], ["1.1"]),
    "drain_timeout": DURATIONS,
    "upstream_pool.max_connections": kind([1, 1024, 100_000], [0]),
    "upstream_pool.wait_timeout": DURATIONS,
    "upstream_pool.connect_timeout": POSITIVE,
    "upstream_pool.idle_timeout": POSITIVE,
    "upstream_pool.dns_refresh": POSITIVE,
    "workers": kind([1], [2]),
    "fleet.redis.url": kind(
        [
            None,
            "redis://127.0.0.1:9/0",
            "rediss://redis.retry:6380",
            "redis://[::1]",
            "redis://u@h/15",
        ],
        [
            "redis://:secret@h",
            "unix:///run/redis.sock",
            "redis+sentinel://h",
            "http://h",
            "redis://h?x=1",
        ],
    ),
    "fleet.redis.key_prefix": kind(["retry-sidecar:", "svc/a:", "x" * 64], ["", "a b", "x" * 65]),
    "fleet.redis.password_env": kind(["RETRY_SIDECAR_REDIS_PASSWORD", None], ["1x"]),
    "fleet.redis.timeout": POSITIVE,
    "fleet.killswitch": BOOLS,
}


def put(doc: dict[str, Any], dotted: str, value: object) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        doc = doc.setdefault(p, {})
    doc[leaf] = value


@st.composite
def documents(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {"version": 1}
    for key, values in TOP_KEYS.items():
        if draw(st.booleans()):
            put(doc, key, draw(JUNK if draw(st.integers(0, 199)) == 0 else values))
    routes = []
    for i in range(draw(st.integers(1, 2))):
        route: dict[str, Any] = {"name": f"r{i}", "upstream": "http://127.0.0.1:9"}
        route["match"] = draw(
            st.sampled_from([{}, {"path_prefix": "/a"}, {"path_regex": "/(a+)+b"}])
        )
        routes.append(route)
    for target in (doc.setdefault("defaults", {}), *routes):
        for key in draw(st.lists(st.sampled_from(sorted(ROUTE_KEYS)), max_size=8, unique=True)):
            put(target, key, draw(ROUTE_KEYS[key]))
    doc["routes"] = routes
    switches = []
    for scope in draw(st.lists(st.sampled_from(["global", "route:r0"]), max_size=2, unique=True)):
        switches.append({"scope": scope, "reason": "INC", "until": draw(instants())})
    if switches:
        doc["killswitches"] = switches
    return doc


def use(sc: Sidecar, config: Config) -> None:
    """What a running process does with the config it applied."""
    now = sc.clock.monotonic()
    status = asyncio.run(take(sc.status))
    status_page(status, View(), None, token_set=False)
    sc.metrics.render()
    json.dumps([route_json(r) for r in config.routes])
    json.dumps([s.as_json() | {"at": iso(s.expires_at)} for s in sc.kill.active(now)])
    explain(config)
    needs_restart(sc.store.current, config)
    rng = random.Random(1)
    for r in config.routes:
        state = sc.states.get(r.name)
        previous = None
        for n in range(1, r.retry.attempts + 1):
            previous = delay(r.retry.backoff, n, previous, rng)
        for t in (now, now + r.timeout, now + 10 * 365 * 86400.0):
            state.breaker.admit(t)
            state.breaker.counts(t)
            state.budget.record_request(t)
            state.budget.try_retry(t)
            state.hedge_budget.try_retry(t)
            state.throttle.record(t, accepted=False)
            state.throttle.probability(t)
            ticket = state.limiter.try_acquire(t)
            if ticket is not None:
                state.limiter.release(t, ticket, r.timeout)
            a = r.retry.auto_timeout
            state.latency.observe(t, r.timeout)
            state.latency.timeout(t, a.percentile, a.multiplier, a.min, a.max)
        int(r.timeout * 1000)  # the x-request-timeout-ms header
        str(timedelta(seconds=r.timeout))


def test_the_fuzz_writes_every_key() -> None:
    """A key added to the model is written by the fuzz too (a key whose value is a list or
    a mapping in the file counts by its name: retry.retry_on, admin.listen)."""
    import dataclasses
    import typing

    from sidecar.config.model import Route

    def leaves(cls: type, prefix: str) -> list[str]:
        out = []
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            sub = hints[f.name]
            if isinstance(sub, type) and dataclasses.is_dataclass(sub):
                out += leaves(sub, prefix + f.name + ".")
            else:
                out.append(prefix + f.name)
        return out

    def written(key: str, table: dict[str, Any]) -> bool:
        return any(key == k or key.startswith(k + ".") for k in table)

    # Written by ``documents`` itself: a route's name, endpoints and match; the version,
    # routes and kill switches; what the loader adds.
    route_own = ("name", "upstreams", "match.")
    top_own = ("version", "routes", "killswitches", "source", "sha256", "warnings")
    assert [
        k for k in leaves(Route, "") if not k.startswith(route_own) and not written(k, ROUTE_KEYS)
    ] == []
    assert [k for k in leaves(Config, "") if k not in top_own and not written(k, TOP_KEYS)] == []


@pytest.mark.slow
@settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(documents())
def test_what_validate_accepts_can_be_applied_and_used(doc: dict[str, Any]) -> None:
    text = yaml.safe_dump(doc, sort_keys=False)
    try:
        config = parse_text(text, "f.yaml")
    except ConfigError as exc:
        assert all(line.startswith("f.yaml:") for line in exc.lines())
        return
    base = parse_text(BASE, "f.yaml")
    sc = Sidecar(base)
    sc.apply(config)  # a reload to it
    assert sc.store.current is config
    use(sc, config)
    sc.apply(base)  # and back
    use(sc, base)
    fresh = Sidecar(config)  # a start with it
    use(fresh, config)

"""The ``fleet:`` section: the shared Redis, validated where it is written, and
``idempotency: {backend: redis}`` / ``fleet.killswitch`` accepted only with a Redis to use."""

from __future__ import annotations

import pytest

from sidecar.config.errors import ConfigError
from sidecar.config.parse import parse_text
from sidecar.config.watch import needs_restart

ROUTES = 'routes: [{name: a, upstream: "http://127.0.0.1:9"}]\n'


def doc(body: str) -> str:
    return f"version: 1\n{body}{ROUTES}"


def issues(text: str) -> list[tuple[int, str, str]]:
    with pytest.raises(ConfigError) as info:
        parse_text(text)
    return [(i.line, i.path, i.message) for i in info.value.issues]


def test_fleet_mode_is_off_by_default() -> None:
    config = parse_text(doc(""))
    assert config.fleet.redis.url is None
    assert config.fleet.redis.key_prefix == "retry-sidecar:"
    assert config.fleet.redis.password_env == "RETRY_SIDECAR_REDIS_PASSWORD"
    assert config.fleet.redis.timeout == 0.25
    assert config.fleet.killswitch is False
    assert config.idempotency.backend == "sqlite"
    assert config.dlq.backend == "sqlite"


@pytest.mark.parametrize(
    "url",
    [
        "redis://redis.retry:6379/0",
        "rediss://redis.retry:6380",
        "redis://127.0.0.1",
        "redis://[::1]:6379/3",
        "redis://default@redis.retry/0",  # an ACL user name; its password from password_env
    ],
)
def test_redis_and_rediss_urls_are_accepted(url: str) -> None:
    text = doc(
        f'fleet:\n  redis: {{url: "{url}", timeout: 1s}}\n  killswitch: false\n'
        "idempotency: {backend: redis}\n"
        "dlq: {backend: redis}\n"
    )
    config = parse_text(text)
    assert config.fleet.redis.url == url
    assert config.fleet.redis.timeout == 1.0
    assert config.idempotency.backend == "redis"
    assert config.dlq.backend == "redis"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis://:hunter2@redis.retry:6379", "password_env"),
        ("redis://user:hunter2@redis.retry", "password in the URL"),
        ("unix:///run/redis.sock", "Unix socket"),
        ("redis+sentinel://s1:26379/mymaster", "Sentinel"),
        ("redis-cluster://c1:7000", "Cluster"),
        ("http://redis.retry:6379", "redis:// or rediss://"),
        ("redis://redis.retry:6379/0?socket_timeout=1", "query parameters"),
        ("redis://redis.retry:6379/zero", "database number"),
        ("redis://redis.retry:99999", "not a valid URL"),
        ("redis://:6379", "no host"),
        ("redis://redis retry:6379/0", "not a host name or IP address: 'redis retry'"),
        ("redis://-redis:6379/0", "not a host name"),
    ],
)
def test_other_url_forms_are_refused_with_line_and_key_path(url: str, says: str) -> None:
    text = doc(f'idempotency: {{backend: sqlite}}\nfleet:\n  redis:\n    url: "{url}"\n')
    [(line, path, message)] = issues(text)
    assert (line, path) == (5, "fleet.redis.url")
    assert says in message


def test_the_redis_backend_without_a_fleet_redis_is_refused_where_it_is_written() -> None:
    text = doc("fleet: {killswitch: false}\nidempotency:\n  backend: redis\n")
    assert issues(text) == [
        (
            4,
            "idempotency.backend",
            "redis needs fleet.redis.url: the keys are kept in the fleet's Redis",
        )
    ]


def test_the_redis_dlq_without_a_fleet_redis_is_refused_where_it_is_written() -> None:
    text = doc("fleet: {killswitch: false}\ndlq:\n  max_records: 10\n  backend: redis\n")
    assert issues(text) == [
        (
            5,
            "dlq.backend",
            "redis needs fleet.redis.url: the records are kept in the fleet's Redis",
        )
    ]


def test_fleet_kill_switches_without_a_redis_are_refused_where_written() -> None:
    text = doc("fleet:\n  redis: {url: null}\n  killswitch: true\n")
    [(line, path, message)] = issues(text)
    assert (line, path) == (4, "fleet.killswitch")
    assert "fleet.redis.url" in message


def test_fleet_kill_switches_with_a_redis_are_accepted() -> None:
    config = parse_text(doc('fleet:\n  redis: {url: "redis://h"}\n  killswitch: true\n'))
    assert config.fleet.killswitch is True


def test_key_prefix_and_timeout_are_checked() -> None:
    text = doc('fleet:\n  redis: {url: "redis://h", key_prefix: "a b", timeout: 0ms}\n')
    assert [(p, line) for line, p, _ in issues(text)] == [
        ("fleet.redis.key_prefix", 3),
        ("fleet.redis.timeout", 3),
    ]


def test_every_fleet_key_needs_a_restart() -> None:
    old = parse_text(doc(""))
    new = parse_text(
        doc(
            "fleet:\n"
            '  redis: {url: "redis://h/1", key_prefix: "b:", password_env: P, timeout: 1s}\n'
            "  killswitch: true\n"
            "idempotency: {backend: redis}\n"
            "dlq: {backend: redis}\n"
        )
    )
    assert sorted(k for k, _ in needs_restart(old, new)) == [
        "dlq.backend",
        "fleet.killswitch",
        "fleet.redis.key_prefix",
        "fleet.redis.password_env",
        "fleet.redis.timeout",
        "fleet.redis.url",
        "idempotency.backend",
    ]

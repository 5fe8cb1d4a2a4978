"""The ``fleet:`` section: the Redis the sidecars of one service share, and what they share
through it. Declared once here (``sidecar/config/schema.py``); ``sidecar/fleet`` connects to it,
the idempotency store keeps keys in it (``idempotency: {backend: redis}``) and the kill switch
shares switches through it (``killswitch: true``).

A Redis URL is ``redis://`` or ``rediss://`` (TLS), ``host[:port][/db]``. Refused, each with
its reason in the message: a password in the URL (it would be shown by ``GET /config`` and
written in a ConfigMap: the password comes from ``password_env``), query parameters (the
options are keys of this section), ``unix://`` (one pod's socket cannot be shared by a fleet),
Sentinel and Cluster forms (not supported: point the URL at a Service that follows the
primary, as a managed Redis or the Bitnami chart provides).
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass, replace
from urllib.parse import urlsplit

from sidecar.config import checks as c
from sidecar.config.idempotency import IdempotencyStorage
from sidecar.config.schema import key, rule, section

SCHEMES = ("redis", "rediss")
_OTHER_FORMS = {
    "unix": "a Unix socket is one pod's: the sidecars of a fleet share a Redis over TCP",
    "redis+sentinel": "Sentinel is not supported: use a URL that follows the primary",
    "sentinel": "Sentinel is not supported: use a URL that follows the primary",
    "redis-sentinel": "Sentinel is not supported: use a URL that follows the primary",
    "redis+cluster": "Redis Cluster is not supported: use one primary (with replicas)",
    "redis-cluster": "Redis Cluster is not supported: use one primary (with replicas)",
}
_PREFIX = re.compile(r"^[\x21-\x7e]{1,64}$")
# A host name (letters, digits, dots, hyphens, underscores as Kubernetes Services may have), an
# IPv4 address, or an IPv6 address (written in brackets in the URL).
_HOST = re.compile(
    r"^(?:[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_])?|[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*)$"
)
MAX_DB = 2**31 - 1


def redis_url(value: object) -> str | None:
    """A ``redis://`` or ``rediss://`` URL, or null (no fleet Redis)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise c.Invalid(f"expected a redis:// or rediss:// URL or null, got {value!r}")
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise c.Invalid(f"not a valid URL: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme in _OTHER_FORMS:
        raise c.Invalid(f"{scheme}:// is refused: {_OTHER_FORMS[scheme]}")
    if scheme not in SCHEMES:
        raise c.Invalid(f"expected a redis:// or rediss:// URL, got {value!r}")
    if parts.password is not None:
        raise c.Invalid(
            "a password in the URL is refused (GET /config and the ConfigMap would show it): "
            "put it in the environment variable that password_env names"
        )
    if not parts.hostname:
        raise c.Invalid("the URL names no host")
    if not _HOST.match(parts.hostname):
        raise c.Invalid(f"not a host name or IP address: {parts.hostname!r}")
    if port == 0:
        raise c.Invalid("the port must be from 1 to 65535")
    if parts.query or parts.fragment:
        raise c.Invalid("query parameters are refused: the options are keys of fleet.redis")
    db = parts.path.lstrip("/")
    if "/" in parts.path.strip("/") or (db and not (db.isdigit() and int(db) <= MAX_DB)):
        raise c.Invalid(f"the path must be a database number (/0), got {parts.path!r}")
    return value


def key_prefix(value: object) -> str:
    if not isinstance(value, str) or not _PREFIX.match(value):
        raise c.Invalid(f"expected 1-64 visible ASCII characters, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class FleetRedis:
    """``fleet.redis``: where the shared Redis is. The client is made at start."""

    url: str | None = key(None, redis_url, live=False)
    key_prefix: str = key("retry-sidecar:", key_prefix, live=False)
    password_env: str | None = key("RETRY_SIDECAR_REDIS_PASSWORD", c.env_name, live=False)
    timeout: float = key(0.25, c.positive_duration, unit="duration", live=False)


@dataclass(frozen=True, slots=True)
class Fleet:
    """The ``fleet:`` section."""

    redis: FleetRedis = section(
        FleetRedis,
        flow=True,
        note='The Redis the sidecars of one service share (see "Fleet mode"); url null: none.\n',
        help=(
            'the Redis the sidecars of one service share; see "Fleet mode". `url`: '
            "`redis://` or `rediss://` (TLS) `host[:port][/db]`, null: no fleet mode (a password "
            "in the URL, query parameters, `unix://`, Sentinel and Cluster forms are refused); "
            "`key_prefix`: before every key, so several services can share one Redis; "
            "`password_env`: the environment variable holding its password (unset: none); "
            "`timeout`: one command, past it the Redis counts as unreachable. Changes need a "
            "restart"
        ),
    )
    killswitch: bool = key(
        False,
        c.boolean,
        live=False,
        note="true: switches set or lifted through any sidecar's admin API apply to all",
        help=(
            "true: a kill switch set or lifted through any sidecar's admin API applies to every "
            'sidecar sharing `fleet.redis` within 2 s (`source: fleet`; see "Fleet mode"); '
            "needs `fleet.redis.url`. Changes need a restart"
        ),
    )

    @property
    def connected(self) -> bool:
        """Whether a fleet Redis is configured at all."""
        return self.redis.url is not None


Problems = list[tuple[str, str]]


@rule(Fleet)
def _killswitch_needs_redis(f: Fleet, written: Collection[str]) -> tuple[Fleet, Problems]:
    if f.killswitch and f.redis.url is None:
        return replace(f, killswitch=False), [
            ("killswitch", "true needs fleet.redis.url: the switches are shared through it")
        ]
    return f, []


def storage_problems(storage: IdempotencyStorage, fleet: Fleet) -> Problems:
    """What the top-level ``idempotency:`` asks of ``fleet:``, as (key of ``idempotency``,
    message)."""
    if storage.backend == "redis" and fleet.redis.url is None:
        return [("backend", "redis needs fleet.redis.url: the keys are kept in the fleet's Redis")]
    return []

"""The admin token: read from the environment variable the config names."""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from collections.abc import Callable

from sidecar.config.model import Admin
from sidecar.telemetry.logs import RateLimit

audit = logging.getLogger("sidecar.audit")


class AdminStartError(Exception):
    """The admin listener must not start as configured."""


def token_from_env(admin: Admin) -> str | None:
    if not admin.token_env:
        return None
    value = os.environ.get(admin.token_env, "")
    return value or None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(admin: Admin, token: str | None) -> None:
    if token is None and not is_loopback(admin.listen.host):
        raise AdminStartError(
            f"the admin listener {admin.listen} is not loopback and no admin token is set: "
            f"set the environment variable {admin.token_env or '(admin.token_env)'} to a secret, "
            "or listen on 127.0.0.1. The admin API can turn retries off and replay writes."
        )


def bearer_ok(header: str | None, token: str) -> bool:
    """Constant-time comparison of ``Authorization: Bearer <token>``. The scheme is matched
    without regard to case (RFC 9110 section 11.1); the credentials are compared as the bytes
    that came (the server decodes a header with surrogateescape: a byte that is not UTF-8
    must not raise in encode())."""
    scheme, _, credentials = (header or "").partition(" ")
    if scheme.lower() != "bearer":
        hmac.compare_digest(b"x", b"y")  # same work either way
        return False
    given = credentials.strip().encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, token.encode())


class FailedLogins:
    """Admin credentials refused (a missing or wrong token, through the API or a form):
    each one counted by ``count(via)``, and logged as an audit line at most 10 a minute (a
    guessing client must not flood the log; the count says how many were not logged)."""

    def __init__(self, count: Callable[[str], None], limit: RateLimit | None = None) -> None:
        self._count = count
        self._limit = limit or RateLimit(per_interval=10, interval=60.0)

    def __call__(self, who: str, via: str, call: str) -> None:
        self._count(via)
        if not self._limit.allow():
            return
        suppressed, self._limit.suppressed = self._limit.suppressed, 0
        audit.warning(
            "admin credentials refused",
            extra={
                "fields": {
                    "audit": "admin.auth-failed",
                    "who": who,
                    "via": via,
                    "call": call,
                    "suppressed": suppressed,
                }
            },
        )

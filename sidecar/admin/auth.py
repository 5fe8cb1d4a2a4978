"""The admin token: read from the environment variable the config names."""

from __future__ import annotations

import hmac
import ipaddress
import os

from sidecar.config.model import Admin


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

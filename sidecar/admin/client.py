"""A small synchronous client for the admin API, for CLI verbs (healthcheck, dlq)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

from sidecar.config.model import Config

# Never through an HTTP proxy: ``http_proxy`` in the environment would otherwise get the admin
# token and the pod's own admin calls (urllib honours it even for 127.0.0.1; kubectl and other
# Go clients never proxy a loopback address). The admin API is reached directly or not at all.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


DEFAULT_TOKEN_ENV = "RETRY_SIDECAR_ADMIN_TOKEN"


@dataclass(frozen=True)
class AdminTarget:
    base: str  # http://host:port
    token: str | None
    token_env: str = DEFAULT_TOKEN_ENV  # the variable the token is read from, for a 401's hint


def target_from(config: Config | None, admin_url: str | None) -> AdminTarget:
    # The token variable named by the config, else the default name.
    token_env = config.admin.token_env if config is not None else DEFAULT_TOKEN_ENV
    token = os.environ.get(token_env) or None if token_env else None
    if admin_url:
        return AdminTarget(admin_url.rstrip("/"), token, token_env or DEFAULT_TOKEN_ENV)
    if config is None:
        raise ValueError("no admin address: give --admin URL or a readable --config")
    host = config.admin.listen.host
    # A wildcard listener is reached on this host's loopback of the same family: ``[::]`` is
    # bound IPv6-only (as nginx's ``listen [::]``), so 127.0.0.1 would find nothing there.
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    if ":" in host:
        host = f"[{host}]"
    return AdminTarget(
        f"http://{host}:{config.admin.listen.port}", token, token_env or DEFAULT_TOKEN_ENV
    )


def unauthorized(target: AdminTarget, body: Any) -> Any:
    """A 401's answer with what to do added to its ``error``: the variable to set (the one
    ``admin.token_env`` names, else ``RETRY_SIDECAR_ADMIN_TOKEN``)."""
    name = target.token_env
    if target.token:
        hint = f"the token in {name} was refused: set {name} to this sidecar's admin token"
    else:
        hint = f"no token sent: set {name} to this sidecar's admin token"
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        return {**body, "error": f"{body['error']} ({hint})"}
    return {"error": f"{body or 'unauthorized'} ({hint})"}


def call(
    target: AdminTarget,
    method: str,
    path: str,
    body: dict[str, Any] | None = None,
    timeout: float = 5.0,
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(target.base + path, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if target.token:
        req.add_header("Authorization", f"Bearer {target.token}")
    try:
        with _DIRECT.open(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        status = exc.code
    try:
        answer: Any = json.loads(raw) if raw else None
    except json.JSONDecodeError:
        answer = raw.decode("utf-8", "replace")
    return status, unauthorized(target, answer) if status == 401 else answer

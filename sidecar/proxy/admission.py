"""Admission: the guards a request passes before anything is sent upstream (head size, target,
route, declared body size, expectation), who sent it and whether it is trusted, and the
request context every later step reads (``context.RequestContext``)."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from aiohttp import web

from sidecar.config.model import Config, IpNetwork
from sidecar.proxy import forward
from sidecar.proxy.context import RequestContext
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.respond import client_error
from sidecar.proxy.routing import Refused, find_route, request_target
from sidecar.proxy.server import GuardedRequestHandler, transport_peer
from sidecar.proxy.tunnel import upgrade_headers, upgrade_wanted
from sidecar.telemetry.logs import RateLimit

if TYPE_CHECKING:
    from opentelemetry.trace import Span


def peer_of(request: web.BaseRequest) -> str:
    proto = request.protocol
    if isinstance(proto, GuardedRequestHandler):
        return proto.peer()
    return transport_peer(request.transport)


_TRUST_CACHE: dict[str, bool] = {}
_TRUST_NETS: list[tuple[IpNetwork, ...]] = [()]


def is_trusted(peer: str, networks: tuple[IpNetwork, ...]) -> bool:
    """Cached per peer address: parsing it on every request cost ~2% of the CPU. The cache is
    dropped when a reload brings other networks, and bounded against address churn."""
    if networks is not _TRUST_NETS[0]:
        _TRUST_NETS[0] = networks
        _TRUST_CACHE.clear()
    hit = _TRUST_CACHE.get(peer)
    if hit is not None:
        return hit
    try:
        addr: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(peer)
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped  # a dual-stack listener sees IPv4 peers as ::ffff:a.b.c.d
        trusted = any(addr in net for net in networks)
    except ValueError:
        trusted = False
    if len(_TRUST_CACHE) >= 4096:
        _TRUST_CACHE.clear()
    _TRUST_CACHE[peer] = trusted
    return trusted


def admit(
    request: web.BaseRequest, deps: ProxyDeps, warnings: RateLimit
) -> RequestContext | web.StreamResponse:
    """The request's context, or the answer that refuses it (431, 400, 404, 413, 417; nothing
    sent upstream, no sequence counted). Its span starts here."""
    config: Config = deps.store.current  # one snapshot for the whole sequence
    method = request.method
    target = request.raw_path
    raw_headers = request.raw_headers
    head_bytes = len(target) + sum(len(k) + len(v) + 4 for k, v in raw_headers)
    if head_bytes > config.limits.max_header_bytes:
        deps.malformed("header-too-large")
        return client_error(
            431, f"request head of {head_bytes} bytes is over {config.limits.max_header_bytes}"
        )
    where = request_target(method, target, request.headers.get("Host"))
    if isinstance(where, Refused):
        return client_error(where.status, where.message)
    target, path = where.origin, where.path
    route = find_route(config.routes, method, path, request.headers.get)
    if route is None:
        return client_error(404, f"no route matches {method} {path}")

    length = request.content_length
    if length is not None and length > config.limits.max_request_body:
        deps.malformed("body-too-large")
        return client_error(
            413, f"request body of {length} bytes is over {config.limits.max_request_body}"
        )

    expect = request.headers.get("Expect")
    if expect is not None and expect.lower() != "100-continue":
        return client_error(417, f"unsupported expectation {expect!r}")

    peer = peer_of(request)
    trusted = is_trusted(peer, config.trusted_peers)
    conn = request.protocol
    tls = conn if isinstance(conn, GuardedRequestHandler) and conn.tls is not None else None
    shared, edge, timeout_ms = forward.request_headers(
        raw_headers,
        peer,
        trusted,
        b"http" if tls is None else b"https",
        default_host=route.upstream.authority.encode(),
        authority=where.authority.encode("latin-1") if where.authority else None,
    )
    if tls is not None and route.forward_client_cert:
        cert = tls.client_cert()
        if cert is not None:
            shared.append((b"X-Forwarded-Client-Cert", cert))
    upgrade = upgrade_wanted(request, route)  # a tunnel asked for (proxy/tunnel.py)
    if upgrade is not None:
        shared.extend(upgrade_headers(upgrade))
    tracing = deps.tracing
    span: Span | None = None
    if tracing.enabled:
        span = tracing.start_server(method, target, route.name, request.headers, peer)
        # Our attempt spans become the parent the upstream sees: the propagators' headers
        # (traceparent, b3...) go with each attempt, the client's are dropped.
        replaced = tracing.replaced
        shared = [(k, v) for k, v in shared if k.lower() not in replaced]
    return RequestContext(
        request,
        deps,
        config,
        route,
        target=target,
        headers=shared,
        # What a DLQ record keeps (before framing). Read only when the route has a DLQ: the
        # copy is skipped otherwise.
        as_received=list(shared) if route.dlq.enabled else shared,
        edge=edge,
        timeout_ms=timeout_ms,
        upgrade=upgrade,
        # The low-level aiohttp server does not answer Expect itself (its router does):
        # without an answer a client waits its expect timeout (curl: 1 s) before sending.
        expects_continue=(expect is not None and request.version == (1, 1) and request.body_exists),
        span=span,
        start=deps.clock.monotonic(),
        warnings=warnings,
    )

"""Admission: the guards a request passes before anything is sent upstream (head size, target,
route, declared body size, expectation), who sent it and whether it is trusted, and the
request context every later step reads (``context.RequestContext``). It reads the front end's
``ClientRequest`` (``proxy/frontend.py``), whatever protocol made it."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from sidecar.config.model import Config, IpNetwork, Route
from sidecar.config.values import Upstream
from sidecar.engine.sender import GrpcCall
from sidecar.proxy import forward
from sidecar.proxy.context import RequestContext
from sidecar.proxy.deps import ProxyDeps
from sidecar.proxy.frontend import ClientRequest, ResponseSink
from sidecar.proxy.grpccall import GrpcSink, grpc_timeout_ms
from sidecar.proxy.respond import Made, refusal
from sidecar.proxy.routing import Refused, find_route, request_target
from sidecar.proxy.tunnel import upgrade_headers, upgrade_wanted
from sidecar.telemetry.logs import RateLimit

if TYPE_CHECKING:
    from opentelemetry.trace import Span


# A gRPC call's fields each attempt sets anew.
GRPC_PER_ATTEMPT = frozenset({b"grpc-timeout", b"grpc-previous-rpc-attempts"})
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


_TLS_HOSTS: dict[tuple[int, str | None], tuple[Upstream, bytes]] = {}
_HOSTS: dict[int, tuple[Upstream, bytes]] = {}


def tls_host(route: Route) -> bytes:
    """The Host an ``https://`` route sends: the name its upstream is verified by
    (``tls.server_name``, else the first URL's host), with the port unless 443. A route whose
    URLs name different hosts sends the first one's: give them one ``server_name``."""
    up = route.upstream
    key = (id(up), route.tls.server_name)
    hit = _TLS_HOSTS.get(key)
    if hit is not None and hit[0] is up:
        return hit[1]
    if len(_TLS_HOSTS) >= 256:
        _TLS_HOSTS.clear()
    name = route.tls.server_name or up.host
    try:
        encoded = name.encode("ascii")
    except UnicodeEncodeError:
        encoded = name.encode("idna")  # an internationalised name, as it is sent as SNI
    if b":" in encoded:
        encoded = b"[" + encoded + b"]"
    value = encoded if up.port == 443 else encoded + b":%d" % up.port
    _TLS_HOSTS[key] = (up, value)
    return value


def default_host(upstream: Upstream) -> bytes:
    """The upstream's authority as a Host value, made once per upstream (its property formats
    a string on every call). Keyed by identity: a reload makes new upstreams, and the cache is
    bounded against their churn."""
    hit = _HOSTS.get(id(upstream))
    if hit is not None and hit[0] is upstream:
        return hit[1]
    if len(_HOSTS) >= 256:
        _HOSTS.clear()
    value = upstream.authority.encode()
    _HOSTS[id(upstream)] = (upstream, value)
    return value


def admit(
    request: ClientRequest,
    sink: ResponseSink,
    deps: ProxyDeps,
    warnings: RateLimit,
    grpc: GrpcSink | None = None,
) -> RequestContext | Made:
    """The request's context, or the answer that refuses it (431, 400, 404, 413, 417; nothing
    sent upstream, no sequence counted). Its span starts here. ``grpc``: a gRPC call's sink
    (``sink`` is it)."""
    config: Config = deps.store.current  # one snapshot for the whole sequence
    method = request.method
    target = request.target
    raw_headers = request.raw_headers
    fields = request.fields
    head_bytes = len(target) + sum(len(k) + len(v) + 4 for k, v in raw_headers)
    if head_bytes > config.limits.max_header_bytes:
        deps.malformed("header-too-large")
        return refusal(
            431, f"request head of {head_bytes} bytes is over {config.limits.max_header_bytes}"
        )
    where = request_target(method, target, fields.get("Host"))
    if isinstance(where, Refused):
        return refusal(where.status, where.message)
    target, path = where.origin, where.path
    route = find_route(config.routes, method, path, fields.get)
    if route is None:
        return refusal(404, f"no route matches {method} {path}")

    length = request.content_length
    if length is not None and length > config.limits.max_request_body:
        deps.malformed("body-too-large")
        return refusal(
            413, f"request body of {length} bytes is over {config.limits.max_request_body}"
        )

    if grpc is not None and route.upstream_protocol != "h2":
        return refusal(
            503,
            f"route {route.name} speaks HTTP/1.1 to its upstream: a gRPC call needs "
            "upstream_protocol: h2",
        )

    expect = fields.get("Expect")
    if expect is not None and expect.lower() != "100-continue":
        return refusal(417, f"unsupported expectation {expect!r}")

    peer = request.peer
    trusted = is_trusted(peer, config.trusted_peers)
    shared, edge, timeout_ms = forward.request_headers(
        raw_headers,
        peer,
        trusted,
        b"https" if request.tls else b"http",
        default_host=default_host(route.upstream),
        authority=where.authority.encode("latin-1") if where.authority else None,
        tls_host=tls_host(route) if route.upstream.tls else None,
    )
    grpc_call: GrpcCall | None = None
    if grpc is not None:
        # The call's deadline is the smaller of grpc-timeout and the route's; each attempt
        # sends the time left as its own grpc-timeout (engine/sender.py), and its count of
        # previous attempts.
        limit = grpc_timeout_ms(fields.get("grpc-timeout"))
        if limit is not None:
            mine = b"%d" % limit
            timeout_ms = mine if timeout_ms is None else timeout_ms + b"," + mine
        previous = next((v for k, v in shared if k.lower() == b"grpc-previous-rpc-attempts"), None)
        grpc_call = GrpcCall(previous, limit is not None)
        shared = [(k, v) for k, v in shared if k.lower() not in GRPC_PER_ATTEMPT]
    if request.client_cert is not None and route.forward_client_cert:
        shared.append((b"X-Forwarded-Client-Cert", request.client_cert))
    # A tunnel asked for (proxy/tunnel.py), on a route that passes upgrades.
    upgrade = upgrade_wanted(request, route) if route.upgrade.enabled else None
    if upgrade is not None:
        shared.extend(upgrade_headers(upgrade))
    tracing = deps.tracing
    span: Span | None = None
    if tracing.enabled:
        span = tracing.start_server(method, target, route.name, fields, peer, tls=request.tls)
        # Our attempt spans become the parent the upstream sees: the propagators' headers
        # (traceparent, b3...) go with each attempt, the client's are dropped.
        replaced = tracing.replaced
        shared = [(k, v) for k, v in shared if k.lower() not in replaced]
    return RequestContext(
        request,
        sink,
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
        expects_continue=(expect is not None and request.version == (1, 1) and request.has_body),
        span=span,
        start=deps.clock.monotonic(),
        warnings=warnings,
        grpc=grpc,
        grpc_call=grpc_call,
    )

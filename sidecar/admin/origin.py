"""Who may talk to the admin listener at all: the rules the admin guard (``server.guard``)
applies to every request before anything else, token or not.

A browser is the danger here, not curl: a page on any site can make the operator's browser
send requests to ``127.0.0.1:15000``. Two ways, both refused:

- **DNS rebinding**: ``rebind.attacker.example`` first resolves to the attacker, then to
  127.0.0.1; the browser then thinks the admin API is same-origin with the attacker's page and
  lets it read every answer. Only the ``Host`` header tells: it names the attacker. So the
  ``Host`` must name a loopback address or ``localhost``, the configured listen address, the
  address the connection arrived at (a probe or a scrape to the pod IP), or one of
  ``admin.allowed_hosts``. A name nobody configured is refused, with a token set or not: the
  token guards the calls that act, this guards what a page could read (``/config``,
  ``/status``, ``/metrics``).
- **Cross-site requests**: a form or a ``fetch(..., {mode: "no-cors"})`` with a
  ``text/plain`` body is sent without a CORS preflight. A browser marks them: a
  ``Sec-Fetch-Site`` other than ``same-origin`` or ``none`` (typed by the user), an ``Origin``
  other than this listener's. Both are refused. One exception: a GET or HEAD that is a
  top-level navigation (``Sec-Fetch-Mode: navigate``: a link followed to the status page) --
  its answer goes to the operator's own tab, never to the page that linked, and no GET acts.
  JSON bodies must also say ``Content-Type: application/json`` (``server.guard``), which no
  browser sends cross-site without a preflight, that this listener never answers.

Clients that send neither ``Origin`` nor ``Sec-Fetch-Site`` (curl, the CLI, probes,
Prometheus) are judged by ``Host`` and the token alone.

One rule more for the status page's form posts when no token is configured: nothing but the
nonce then stands between a page and an action, and a page that has rebound a name of
``admin.allowed_hosts`` to this listener reads the nonce like the operator's own tab does. So
without a token a form acts only for a ``Host`` naming a loopback address or ``localhost``
(``form_host_refusal``), names no page on the internet can rebind.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from sidecar.admin.auth import is_loopback

SAFE_SITES = frozenset({"same-origin", "none"})
UNSPECIFIED = frozenset({"0.0.0.0", "::"})


@dataclass(frozen=True, slots=True)
class Refusal:
    status: int
    message: str


def host_name(host: str) -> str | None:
    """The name part of a Host header, normalised for comparison (lower case, no port, no
    trailing dot, an IP address in its canonical form): ``[::1]:15000`` -> ``::1``,
    ``LocalHost.:80`` -> ``localhost``. None for a value that is not ``host[:port]``."""
    host = host.strip().lower()
    if host.startswith("["):
        name, sep, rest = host[1:].partition("]")
        if not sep or (rest and not (rest.startswith(":") and rest[1:].isdigit())):
            return None
    else:
        name, sep, port = host.partition(":")
        if sep and not port.isdigit():
            return None
    name = name.rstrip(".")
    if not name or any(c in name for c in " \t/\\?#@%"):
        return None
    return canonical(name)


def canonical(name: str) -> str:
    """An IP address in its canonical text (an IPv4-mapped IPv6 address as IPv4); a name as
    it is."""
    try:
        ip = ipaddress.ip_address(name)
    except ValueError:
        return name
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def host_refusal(
    hosts: list[str], allowed: Collection[str], listen_host: str, local: str | None
) -> Refusal | None:
    """The ``Host`` check. ``hosts``: every Host header the request carried; ``allowed``:
    ``admin.allowed_hosts``; ``listen_host``: ``admin.listen``'s host; ``local``: the address
    the connection arrived at. A request without Host (HTTP/1.0; never a browser) passes."""
    if not hosts:
        return None
    if len(hosts) > 1:
        return Refusal(400, "more than one Host header")
    name = host_name(hosts[0])
    if name is None:
        return Refusal(400, "the Host header is not host[:port]")
    if (
        is_loopback(name)
        or name in allowed
        or (listen_host not in UNSPECIFIED and name == canonical(listen_host))
        or (local is not None and name == canonical(local))
    ):
        return None
    return Refusal(
        421,
        f"this admin listener does not answer to the host {name!r}; add it to "
        "admin.allowed_hosts if it is yours (a name nobody configured is how a DNS-rebinding "
        "page reaches a loopback admin API)",
    )


def site_refusal(method: str, headers: Mapping[str, str]) -> Refusal | None:
    """The cross-site check: ``Sec-Fetch-Site`` (set by the browser itself, a page cannot
    forge it) and ``Origin``, which must be this listener's own, ``http://<Host>``.
    ``Origin: null`` (an opaque or privacy-stripped origin) passes only when the browser
    says same-origin."""
    site = headers.get("Sec-Fetch-Site")
    origin = headers.get("Origin")
    navigation = method in ("GET", "HEAD") and headers.get("Sec-Fetch-Mode") == "navigate"
    if site is not None and site.lower() not in SAFE_SITES and not navigation:
        return Refusal(403, f"cross-site requests are refused (Sec-Fetch-Site: {site})")
    if origin is not None:
        host = headers.get("Host")
        own = host is not None and origin.lower() == f"http://{host}".lower()
        vouched = origin == "null" and site is not None and site.lower() == "same-origin"
        if not own and not vouched:
            return Refusal(403, f"cross-origin requests are refused (Origin: {origin})")
    return None


def form_host_refusal(hosts: list[str]) -> Refusal | None:
    """The Host check for a status-page form post when no admin token is configured: exactly
    one Host, naming a loopback address or ``localhost``. ``admin.allowed_hosts`` and the
    address the connection arrived at do not count here: a name a DNS-rebinding page can
    take over must not act without a token."""
    name = host_name(hosts[0]) if len(hosts) == 1 else None
    if name is not None and is_loopback(name):
        return None
    return Refusal(
        403,
        "without an admin token the status page's forms act only for a loopback Host "
        "(127.0.0.1, [::1], localhost); configure admin.token_env to use them through "
        "another name",
    )

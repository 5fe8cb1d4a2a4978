"""Upstream host names resolved to all their addresses, each one an endpoint of the route.

``refresh`` looks every host name of the current config up (IP literals need nothing) and
hands each route its endpoints; the app runs it at start, after every reload and every
``upstream_pool.dns_refresh`` in a named background task. A lookup that fails keeps the
addresses the name had before (or the name itself, which the connection then resolves as it
always did): a DNS hiccup never takes endpoints away.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable

from sidecar.config.model import Config, Upstream
from sidecar.engine.routestate import RouteStates

log = logging.getLogger("sidecar.resolve")

Lookup = Callable[[str, int], Awaitable[list[str]]]
LOOKUP_TIMEOUT = 5.0


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


async def system_lookup(host: str, port: int) -> list[str]:
    """The addresses ``getaddrinfo`` gives for ``host``, in its order, without duplicates."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    out: list[str] = []
    for _family, _type, _proto, _name, addr in infos:
        ip = str(addr[0])
        if ip not in out:
            out.append(ip)
    return out


class Resolver:
    def __init__(self, states: RouteStates, lookup: Lookup = system_lookup) -> None:
        self._states = states
        self._lookup = lookup
        self._known: dict[tuple[str, int], list[str]] = {}

    @staticmethod
    def needed(config: Config) -> bool:
        return any(not is_ip(u.host) for r in config.routes for u in r.upstreams)

    async def _addresses(self, u: Upstream) -> list[tuple[str, int, str]]:
        if is_ip(u.host):
            return [(u.host, u.port, u.authority)]
        key = (u.host, u.port)
        try:
            async with asyncio.timeout(LOOKUP_TIMEOUT):
                ips = await self._lookup(u.host, u.port)
        except (OSError, TimeoutError, UnicodeError) as exc:
            log.warning("cannot resolve upstream %s: %s (keeping what it had)", u.authority, exc)
            ips = []
        if ips:
            self._known[key] = ips
        else:
            ips = self._known.get(key, [u.host])
        return [(ip, u.port, u.authority) for ip in ips]

    async def refresh(self, config: Config) -> None:
        for route in config.routes:
            addresses: list[tuple[str, int, str]] = []
            for u in route.upstreams:
                for a in await self._addresses(u):
                    if a[:2] not in [b[:2] for b in addresses]:
                        addresses.append(a)
            st = self._states.get(route.name)
            if st.upstreams == route.upstreams:  # not reloaded with others meanwhile
                st.endpoints.update(addresses)

    async def watch(self, current: Callable[[], Config], interval: Callable[[], float]) -> None:
        while True:
            config = current()
            if self.needed(config):
                await self.refresh(config)
            await asyncio.sleep(interval())

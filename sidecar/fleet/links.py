"""The fleet's Redis links of one process, by use: one view of every link for the gauge, the
status page, ``GET /status`` and ``retry-sidecar status``.

Each use of the fleet's Redis (the kill switches, the idempotency keys, the DLQ) makes its own
``FleetLink``, named for the use where it is made, and adds it here; the use keeps owning the
link's lifetime (it closes it), and a closed link drops out of the view. The registry is the
app's (one per process, no global): it only reads each link's state, as the gauges read their
owners at scrape time.

A link's state is what its last call found, and a use may make no call for a long time (a
quiet route's idempotency keys): a Redis that answers again after a pause would stay shown
unreachable, and its alert fire, until the next request. So the app runs ``probe_forever``
(the ``fleet-probe`` task): every ``PROBE_EVERY`` seconds, each open link that is not
connected, and whose pause after its failure is over, is sent one PING through its own
``FleetLink.call``; a success brings it back (its gauge 1, its "answers again" line). A
connected link is never probed: no traffic of the probe's while Redis answers.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from sidecar.fleet.connection import FleetLink, FleetUnavailable, ping

PROBE_EVERY = 0.5  # seconds between two looks for a link to probe


@dataclass(frozen=True, slots=True)
class LinkState:
    """One use's link as the views show it."""

    use: str  # the name its owner gave it: killswitch, idempotency, dlq
    connected: bool  # the last call reached Redis (True before the first call)
    error: str | None  # while unreachable: the failure's text, Redis's own words
    while_unreachable: str  # what the use does meanwhile, as its owner says it

    @property
    def state(self) -> str:
        return "connected" if self.connected else "unreachable"


class FleetLinks:
    """The links the uses made, by use name; reads their state, owns none of them."""

    def __init__(self) -> None:
        self._links: dict[str, tuple[FleetLink, str]] = {}

    def add(self, link: FleetLink, while_unreachable: str) -> FleetLink:
        """``link`` shown under its use's name until it is closed, with what its use does while
        the Redis is unreachable."""
        assert link.use, "a link shown in the fleet view needs its use's name"
        self._links[link.use] = (link, while_unreachable)
        return link

    def states(self) -> list[LinkState]:
        """The open links, by use name."""
        return [
            LinkState(use, link.connected, link.last_error, said)
            for use, (link, said) in sorted(self._links.items())
            if not link.closed
        ]

    def to_probe(self) -> list[FleetLink]:
        """The open links that are not connected and whose pause after a failure is over."""
        return [
            link
            for link, _ in self._links.values()
            if not link.closed and not link.connected and link.may_try()
        ]

    async def probe(self) -> None:
        """One PING through each link ``to_probe``, each bounded by its link's timeout; a
        failure is the link's (its pause grows, its warning is rate-limited) and ends nothing."""
        for link in self.to_probe():
            with contextlib.suppress(FleetUnavailable):
                await link.call(ping)

    async def probe_forever(self, every: float = PROBE_EVERY) -> None:
        """Run until cancelled: ``probe`` every ``every`` seconds."""
        while True:
            await asyncio.sleep(every)
            await self.probe()

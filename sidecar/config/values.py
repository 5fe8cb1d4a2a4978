"""The small value types a config key holds (an address, an endpoint, the retried outcomes, a
compiled path pattern), below the schema so that both the checks and the model name them."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal, Protocol

from sidecar.outcomes import (
    DEFAULT_RETRY_GRPC,
    DEFAULT_RETRY_KINDS,
    DEFAULT_RETRY_STATUSES,
    OutcomeKind,
)

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
# What a route speaks to its upstreams (``upstream_protocol``).
UpstreamProtocol = Literal["http1", "h2", "auto"]
UPSTREAM_PROTOCOLS: tuple[UpstreamProtocol, ...] = ("http1", "h2", "auto")

# RFC 9110 section 9.2.2 (what may be retried after its bytes may have reached the upstream).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# What a route that turns hedging on hedges unless it lists more (``hedge.methods``): the safe
# methods, whose duplicate cannot change what the winner answers.
HEDGE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class RetryOn:
    """The outcomes that may be retried: failure kinds (the ``retry_on`` words of
    ``sidecar.outcomes``), upstream statuses, and the gRPC statuses of a gRPC call's answer."""

    kinds: frozenset[OutcomeKind] = DEFAULT_RETRY_KINDS
    statuses: frozenset[int] = DEFAULT_RETRY_STATUSES
    grpc: frozenset[int] = DEFAULT_RETRY_GRPC


class PathPattern(Protocol):
    """A compiled ``path_regex`` (RE2's, see config/checks.py): its source and a full match."""

    @property
    def pattern(self) -> str: ...

    def fullmatch(self, text: str) -> object | None: ...


@dataclass(frozen=True, slots=True)
class Upstream:
    host: str
    port: int
    tls: bool = False  # https://: the route's ``tls:`` section says how it is verified

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    def __str__(self) -> str:
        return f"{self.scheme}://{self.authority}"


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

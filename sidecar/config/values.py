"""The small value types a config key holds (an address, an endpoint, the retried outcomes, a
compiled path pattern), below the schema so that both the checks and the model name them."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Protocol

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

# RFC 9110 section 9.2.2 (what may be retried after its bytes may have reached the upstream).
IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE", "TRACE"})
# What a route that turns hedging on hedges unless it lists more (``hedge.methods``): the safe
# methods, whose duplicate cannot change what the winner answers.
HEDGE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


@dataclass(frozen=True, slots=True)
class RetryOn:
    """The outcomes that may be retried."""

    connect_failure: bool = True
    reset: bool = True
    per_try_timeout: bool = True
    statuses: frozenset[int] = frozenset({502, 503, 504})


class PathPattern(Protocol):
    """A compiled ``path_regex`` (RE2's, see config/checks.py): its source and a full match."""

    @property
    def pattern(self) -> str: ...

    def fullmatch(self, text: str) -> object | None: ...


@dataclass(frozen=True, slots=True)
class Upstream:
    host: str
    port: int

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def __str__(self) -> str:
        return f"http://{self.authority}"


@dataclass(frozen=True, slots=True)
class Listen:
    host: str
    port: int

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

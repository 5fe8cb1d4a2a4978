"""What the proxy handler needs: the engine's dependencies plus the config store and DLQ."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sidecar.config.store import ConfigStore
from sidecar.engine.deps import EngineDeps
from sidecar.idempotency.holding import Holdings
from sidecar.idempotency.store import IdempotencyStore
from sidecar.proxy.detached import DetachedWrites
from sidecar.proxy.tunnel import Tunnels

if TYPE_CHECKING:
    # A store is loaded only when a DLQ opens: a type here, nothing more.
    from sidecar.dlq.contract import DlqStorage


@dataclass
class ProxyDeps(EngineDeps):
    store: ConfigStore
    malformed: Callable[[str], None] = lambda reason: None  # counts refused requests
    # the access log's line for a request refused before routing: (method, target, status)
    refused: Callable[[str, str, int], None] = lambda method, target, status: None
    dlq: DlqStorage | None = None
    dlq_write: Callable[[str, str], None] = lambda route, result: None  # (route, result)
    tunnels: Tunnels = field(default_factory=Tunnels)  # upgraded connections being relayed
    # The idempotency store, once opened (app.py); None: not open, guarded writes get
    # their route's on_store_error.
    idempotency: IdempotencyStore | None = None
    idempotency_result: Callable[[str, str], None] = lambda route, result: None
    # The keys this process holds and the settlements it retries (app.py stops them).
    holdings: Holdings | None = None
    # Guarded writes in flight, run on when their client leaves; the app waits for them at stop.
    detached: DetachedWrites = field(default_factory=DetachedWrites)

"""What the proxy handler and the sequence runner share."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from sidecar.admin.killswitch import KillSwitch
from sidecar.config.store import ConfigStore
from sidecar.dlq.store import DlqStore
from sidecar.lifecycle import Lifecycle
from sidecar.retry.loop import Clock
from sidecar.retry.routestate import RouteStates
from sidecar.telemetry.events import EventSink
from sidecar.telemetry.tracing import Tracing
from sidecar.upstream.client import UpstreamClient


@dataclass
class ProxyDeps:
    store: ConfigStore
    client: UpstreamClient
    clock: Clock
    rng: random.Random
    events: EventSink
    states: RouteStates
    kill: KillSwitch
    life: Lifecycle
    tracing: Tracing
    malformed: Callable[[str], None] = lambda reason: None  # counts refused requests
    dlq: DlqStore | None = None
    dlq_write: Callable[[str, str], None] = lambda route, result: None  # (route, result)

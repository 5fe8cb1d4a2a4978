"""What the engine needs from the process: shared by the proxy handler and DLQ replays."""

from __future__ import annotations

import random
from dataclasses import dataclass

from sidecar.core import Clock
from sidecar.engine.gate import Switches
from sidecar.engine.routestate import RouteStates
from sidecar.lifecycle import Lifecycle
from sidecar.telemetry.events import EventSink
from sidecar.telemetry.tracing import Tracing
from sidecar.upstream.client import UpstreamClient


@dataclass
class EngineDeps:
    client: UpstreamClient
    clock: Clock
    rng: random.Random
    events: EventSink
    states: RouteStates
    kill: Switches
    life: Lifecycle
    tracing: Tracing

"""What the proxy handler needs: the engine's dependencies plus the config store and DLQ."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sidecar.config.store import ConfigStore
from sidecar.dlq.store import DlqStore
from sidecar.engine.deps import EngineDeps


@dataclass
class ProxyDeps(EngineDeps):
    store: ConfigStore
    malformed: Callable[[str], None] = lambda reason: None  # counts refused requests
    dlq: DlqStore | None = None
    dlq_write: Callable[[str, str], None] = lambda route, result: None  # (route, result)

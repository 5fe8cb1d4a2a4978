"""The top-level ``telemetry:`` section: what the sidecar tells about the requests it proxies
besides its metrics and spans. Declared once here (``sidecar/config/schema.py``); the access log
(``sidecar/telemetry/requestlog.py``) reads it on every request, so a reload applies at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config import checks as c
from sidecar.config.schema import key


@dataclass(frozen=True, slots=True)
class Telemetry:
    access_log: bool = key(
        True,
        c.boolean,
        note="one JSON line per finished request at info (logger sidecar.access)",
        help=(
            "one JSON line per finished request at `info` (logger `sidecar.access`): method, "
            "route, path (no query), status, duration, attempts, fate, upstream, bytes"
        ),
    )

"""The access log: one JSON line per finished request at ``info`` (logger ``sidecar.access``),
on unless the config says ``access_log: false``, as nginx's and Envoy's are.

An event sink asked on every request, so it is in the compiled build; off (the key, or a log
level above info) it costs a level check and a config read per request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from json import dumps

from sidecar import outcomes
from sidecar.telemetry.events import (
    AttemptEnded,
    BreakerTransitioned,
    HedgeEvent,
    RetrySent,
    SequenceEnded,
)
from sidecar.telemetry.logs import TRACE, write_line
from sidecar.telemetry.tracing import redacted_path

# The fate of a request refused before routing, in the access log only (never a route's).
NOT_ROUTED = "not-routed"


class RequestLog:
    """An EventSink writing the access log; ``on`` says whether the config has it on."""

    def __init__(self, on: Callable[[], bool]) -> None:
        self.log = logging.getLogger("sidecar.access")
        self.on = on

    def attempt_ended(self, event: AttemptEnded) -> None:
        pass

    def retry_sent(self, event: RetrySent) -> None:
        pass

    def hedged(self, event: HedgeEvent) -> None:
        pass

    def breaker_transitioned(self, event: BreakerTransitioned) -> None:
        pass

    def refused(self, method: str | None, target: str | None, status: int) -> None:
        """A request refused before any route took it (no route matched, a malformed or too
        large head, a head too slow), logged as nginx logs its 400s and 404s: no route, no
        attempt; ``method`` and ``target`` None when the head never parsed."""
        if not (self.log.isEnabledFor(logging.INFO) and self.on()):
            return
        path = redacted_path(target.partition("?")[0]) if target is not None else None
        fields: dict[str, object] = {
            "method": method,
            "route": None,
            "path": path,
            "status": status,
            "duration": 0.0,
            "attempts": 0,
            "fate": NOT_ROUTED,
            "upstream": None,
            "bytes": 0,
            "proxy_error": outcomes.BAD_REQUEST.code,
        }
        line = (
            f'{{"ts": {time.time():.3f}, "level": "info", "logger": "sidecar.access", '
            '"msg": "access", ' + ", ".join(f"{dumps(k)}: {dumps(v)}" for k, v in fields.items())
        )
        if not write_line(line + "}"):
            self.log.info("access", extra={"fields": fields})

    def sequence_ended(self, event: SequenceEnded) -> None:
        if not (self.log.isEnabledFor(logging.INFO) and self.on()):
            return
        # The query may hold secrets (tokens, signatures): never logged.
        path = redacted_path(event.target.partition("?")[0])
        # Formatted here as JsonFormatter would (its keys, in its order): the logging
        # machinery costs four times as much per line as the line itself.
        line = (
            f'{{"ts": {time.time():.3f}, "level": "info", "logger": "sidecar.access", '
            f'"msg": "access", "method": {dumps(event.method)}, "route": {dumps(event.route)}, '
            f'"path": {dumps(path)}, "status": {event.status}, '
            f'"duration": {round(event.duration, 6)!r}, "attempts": {event.attempts}, '
            f'"fate": {dumps(event.fate)}, "upstream": {dumps(event.upstream or None)}, '
            f'"bytes": {event.sent}'
        )
        if event.proxy_error is not None:
            line += ', "proxy_error": ' + dumps(event.proxy_error)
        ids = TRACE.get()
        if ids is not None:
            line += f', "trace_id": "{ids[0]}", "span_id": "{ids[1]}"'
        if write_line(line + "}"):
            return
        fields: dict[str, object] = {
            "method": event.method,
            "route": event.route,
            "path": path,
            "status": event.status,
            "duration": round(event.duration, 6),
            "attempts": event.attempts,
            "fate": event.fate,
            "upstream": event.upstream or None,
            "bytes": event.sent,
        }
        if event.proxy_error is not None:
            fields["proxy_error"] = event.proxy_error
        self.log.info("access", extra={"fields": fields})

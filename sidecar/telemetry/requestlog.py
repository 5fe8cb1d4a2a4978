"""The access log: one JSON line per finished request at ``info`` (logger ``sidecar.access``),
on unless the config says ``access_log: false``, as nginx's and Envoy's are.

An event sink asked on every request, so it is in the compiled build; off (the key, or a log
level above info) it costs a level check and a config read per request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sidecar.telemetry.events import (
    AttemptEnded,
    BreakerTransitioned,
    HedgeEvent,
    RetrySent,
    SequenceEnded,
)


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

    def sequence_ended(self, event: SequenceEnded) -> None:
        if not (self.log.isEnabledFor(logging.INFO) and self.on()):
            return
        fields: dict[str, object] = {
            "method": event.method,
            "route": event.route,
            # The query may hold secrets (tokens, signatures): never logged.
            "path": event.target.partition("?")[0],
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

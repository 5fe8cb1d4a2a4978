"""The per-request log: one JSON line per finished request, at debug level only.

An event sink asked on every request, so it is in the compiled build; when debug logging is
off (the default) it costs one level check per request.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from sidecar.telemetry.events import (
    AttemptEnded,
    BreakerTransitioned,
    HedgeEvent,
    RetrySent,
    SequenceEnded,
)


class RequestLog:
    """An EventSink writing one JSON line per finished request, at debug level only."""

    def __init__(self) -> None:
        self.log = logging.getLogger("sidecar.request")

    def attempt_ended(self, event: AttemptEnded) -> None:
        pass

    def retry_sent(self, event: RetrySent) -> None:
        pass

    def hedged(self, event: HedgeEvent) -> None:
        pass

    def breaker_transitioned(self, event: BreakerTransitioned) -> None:
        pass

    def sequence_ended(self, event: SequenceEnded) -> None:
        if self.log.isEnabledFor(logging.DEBUG):
            fields = asdict(event)
            self.log.debug("request", extra={"fields": fields})

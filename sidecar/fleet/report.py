"""What the fleet's Redis last failed with, and when that is worth a warning in the log.

A Redis that refuses the password (``WRONGPASS``/``NOAUTH``), has no such database, or refuses
the connection fails every call, each a second or less apart: each call's error is the same.
The log gets one warning per kind of error (``AuthenticationError``, ``ConnectionError``, a
timeout...) per ``REPORT_EVERY`` seconds, with the error's own text and how many of that kind
were left out since the last warning; the status page shows the last error's text beside
"unreachable". The first success after a warning is told as well ("answers again"), once: so
the log says when an outage began and when it ended, and no more lines than warnings were
told. Pure: times are the caller's monotonic clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REPORT_EVERY = 30.0  # seconds between two warnings of one kind of error


@dataclass(slots=True)
class ErrorReport:
    """The last failure's text, and a warning per kind at most every ``REPORT_EVERY`` s."""

    every: float = REPORT_EVERY
    subject: str = "the fleet Redis"  # what failed, as the log names it
    last: str | None = None  # the last failure's text; None once a call succeeded
    _told: bool = False  # a warning was told since the last success
    _next: dict[str, float] = field(default_factory=dict)  # kind: when it may be told again
    _left_out: dict[str, int] = field(default_factory=dict)  # kind: failures not told since

    def failed(self, kind: str, text: str, now: float) -> str | None:
        """Note a failure; the warning to log now, or None when this kind was told recently."""
        self.last = text
        if now < self._next.get(kind, now):
            self._left_out[kind] = self._left_out.get(kind, 0) + 1
            return None
        self._next[kind] = now + self.every
        self._told = True
        left_out = self._left_out.pop(kind, 0)
        more = f" ({left_out} more like it since the last warning)" if left_out else ""
        return f"{self.subject} failed: {text}{more}"

    def succeeded(self) -> str | None:
        """Note a success; the line to log now (once after a warning), else None."""
        self.last = None
        if not self._told:
            return None
        self._told = False
        return f"{self.subject} answers again"

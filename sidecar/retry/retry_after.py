"""Retry-After parsing (RFC 9110 section 10.2.3): delay-seconds or an HTTP-date."""

from __future__ import annotations

from email.utils import parsedate_to_datetime

MAX_DELAY_SECONDS = 10 * 365 * 86400


def parse_retry_after(value: str | None, now_wall: float) -> float | None:
    """Seconds to wait, or None when absent or garbage. A date in the past gives 0.

    ``now_wall`` is the wall clock (epoch seconds), injected so tests need no real time.
    """
    if value is None:
        return None
    v = value.strip()
    if not v:
        return None
    if v.isdigit() and v.isascii():
        # Cap before int() so a 10,000-digit value cannot cost much.
        if len(v) > 12:
            return float(MAX_DELAY_SECONDS)
        return float(min(int(v), MAX_DELAY_SECONDS))
    if v[0] in "+-" or not any(c.isalpha() for c in v):
        return None
    try:
        when = parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        # RFC 9110 dates are always GMT; a date without a zone is not one of its forms.
        return None
    return min(max(0.0, when.timestamp() - now_wall), float(MAX_DELAY_SECONDS))

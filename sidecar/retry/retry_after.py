"""Retry-After parsing (RFC 9110 section 10.2.3): delay-seconds or an HTTP-date.

An HTTP-date (RFC 9110 section 5.6.7) comes in three forms, all in GMT, and a recipient must
accept all three:

    Sun, 06 Nov 1994 08:49:37 GMT    IMF-fixdate
    Sunday, 06-Nov-94 08:49:37 GMT   obsolete RFC 850 format
    Sun Nov  6 08:49:37 1994         ANSI C's asctime() format (no zone: it is GMT)

Other date shapes with an explicit zone (``+0100``) are accepted as ``email.utils`` reads them.
"""

from __future__ import annotations

import calendar
import re
from datetime import date
from email.utils import parsedate_to_datetime

MAX_DELAY_SECONDS = 10 * 365 * 86400

_DAY = r"(?:Mon|Tue|Wed|Thu|Fri|Sat|Sun)"
_DAY_LONG = r"(?:Monday|Tuesday|Wednesday|Thursday|Friday|Saturday|Sunday)"
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")
_MON = "(" + "|".join(_MONTHS) + ")"
_TIME = r"(\d\d):(\d\d):(\d\d)"
IMF_FIXDATE = re.compile(rf"{_DAY}, (\d\d) {_MON} (\d{{4}}) {_TIME} GMT")
RFC850_DATE = re.compile(rf"{_DAY_LONG}, (\d\d)-{_MON}-(\d\d) {_TIME} GMT")
ASCTIME_DATE = re.compile(rf"{_DAY} {_MON} ( \d|\d\d?) {_TIME} (\d{{4}})")  # also "Nov 6"


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
    when = http_date(v, now_wall)
    if when is None:
        return None
    return min(max(0.0, when - now_wall), float(MAX_DELAY_SECONDS))


def http_date(v: str, now_wall: float) -> float | None:
    """An HTTP-date as epoch seconds, or None."""
    if len(v) > 64 or not v.isascii():
        return None
    m = IMF_FIXDATE.fullmatch(v)
    if m:
        day, mon, year, hh, mm, ss = m.groups()
        return _epoch(int(year), mon, int(day), int(hh), int(mm), int(ss))
    m = RFC850_DATE.fullmatch(v)
    if m:
        day, mon, yy, hh, mm, ss = m.groups()
        year = _full_year(int(yy), now_wall)
        return _epoch(year, mon, int(day), int(hh), int(mm), int(ss))
    m = ASCTIME_DATE.fullmatch(v)
    if m:
        mon, day, hh, mm, ss, year = m.groups()
        return _epoch(int(year), mon, int(day), int(hh), int(mm), int(ss))
    return _other_date(v)


def _full_year(yy: int, now_wall: float) -> int:
    """RFC 9110: a two-digit year that would be more than 50 years in the future is the most
    recent past year with the same last two digits."""
    this_year = int(1970 + now_wall // 31_556_952)  # mean Gregorian year; off by a day at most
    year = this_year - this_year % 100 + yy
    if year > this_year + 50:
        year -= 100
    return year


def _epoch(year: int, mon: str, day: int, hh: int, mm: int, ss: int) -> float | None:
    month = _MONTHS.index(mon) + 1
    try:
        date(year, month, day)
    except ValueError:
        return None
    if hh > 23 or mm > 59 or ss > 60:  # 60: a leap second
        return None
    return float(calendar.timegm((year, month, day, hh, mm, ss, 0, 0, 0)))


def _other_date(v: str) -> float | None:
    """Lenient: other shapes, but only with an explicit zone (a date without one is none of
    the RFC's forms, and guessing its zone could be hours off)."""
    if v[0] in "+-" or not any(c.isalpha() for c in v):
        return None
    try:
        when = parsedate_to_datetime(v)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when is None or when.tzinfo is None:
        return None
    return when.timestamp()


def parse_pushback(value: str) -> float | None:
    """A gRPC ``grpc-retry-pushback-ms`` (gRFC A6): a signed 32-bit integer of milliseconds,
    as seconds; None when it says "do not retry" (negative, or not such an integer)."""
    v = value.strip()
    digits = v[1:] if v[:1] in ("+", "-") else v
    if not digits.isdigit() or not digits.isascii() or len(digits) > 10:
        return None
    n = int(v)
    if n < 0 or n > 2**31 - 1:
        return None
    return n / 1000.0

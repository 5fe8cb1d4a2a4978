from datetime import UTC, datetime
from email.utils import format_datetime

import pytest

from sidecar.retry.retry_after import MAX_DELAY_SECONDS, parse_retry_after

NOW = 1_700_000_000.0


def http_date(epoch: float) -> str:
    return format_datetime(datetime.fromtimestamp(epoch, UTC), usegmt=True)


def test_delay_seconds():
    assert parse_retry_after("7", NOW) == 7.0
    assert parse_retry_after(" 0 ", NOW) == 0.0


def test_http_date_in_future_and_past():
    assert parse_retry_after(http_date(NOW + 12), NOW) == pytest.approx(12.0)
    assert parse_retry_after(http_date(NOW - 100), NOW) == 0.0


def test_obsolete_date_forms_are_accepted():
    # RFC 850 form, which RFC 9110 requires recipients to accept.
    assert parse_retry_after("Sunday, 06-Nov-94 08:49:37 GMT", 784111777.0 - 3) == pytest.approx(3)


@pytest.mark.parametrize(
    "value", [None, "", "soon", "-5", "1.5", "+3", "Mon, 99 Foo 2024 xx:yy:zz GMT", "\x00", "٣"]
)
def test_garbage_is_none(value):
    assert parse_retry_after(value, NOW) is None


def test_enormous_values_are_clamped_cheaply():
    assert parse_retry_after("9" * 10000, NOW) == float(MAX_DELAY_SECONDS)


# -- the three HTTP-date forms of RFC 9110 section 5.6.7 -------------------------------------

RFC_EXAMPLE_EPOCH = 784111777.0  # 1994-11-06T08:49:37Z, the RFC's example instant


@pytest.mark.parametrize(
    "value",
    [
        "Sun, 06 Nov 1994 08:49:37 GMT",  # IMF-fixdate
        "Sunday, 06-Nov-94 08:49:37 GMT",  # obsolete RFC 850 format
        "Sun Nov  6 08:49:37 1994",  # ANSI C's asctime() format
    ],
)
def test_the_rfc_examples_of_all_three_forms(value):
    """RFC 9110: a recipient that parses a timestamp MUST accept all three HTTP-date formats;
    the asctime form carries no zone and is GMT."""
    assert parse_retry_after(value, RFC_EXAMPLE_EPOCH - 3) == 3.0


def test_asctime_matches_the_c_library_and_email_utils():
    """Differential: dates written by the C library's asctime() (via time.asctime) and by
    email.utils (IMF-fixdate), for instants across the years, all read back exactly."""
    import random
    import time
    from email.utils import formatdate, parsedate_to_datetime

    rng = random.Random(9110)
    for _ in range(2000):
        t = float(rng.randrange(0, 4_102_444_800))  # 1970 .. 2100
        now = t - 5
        asctime = time.asctime(time.gmtime(t))
        imf = formatdate(t, usegmt=True)
        assert parse_retry_after(asctime, now) == 5.0, asctime
        assert parse_retry_after(imf, now) == 5.0, imf
        assert parsedate_to_datetime(imf).timestamp() == t  # the reference agrees


def test_rfc850_two_digit_years_follow_the_fifty_year_rule():
    """RFC 9110: a two-digit year more than 50 years in the future is the most recent past
    year with those digits (email.utils pivots at 69 instead)."""
    from datetime import datetime

    now = datetime(2025, 6, 1, tzinfo=UTC).timestamp()
    future_2070 = datetime(2070, 1, 1, tzinfo=UTC).timestamp()
    # 2070 is 45 years ahead: it stays 2070 (capped by MAX_DELAY_SECONDS as any far date).
    assert parse_retry_after("Wednesday, 01-Jan-70 00:00:00 GMT", now) == min(
        future_2070 - now, float(MAX_DELAY_SECONDS)
    )
    # 2080 would be 55 years ahead: it is 1980, in the past, so no wait.
    assert parse_retry_after("Tuesday, 01-Jan-80 00:00:00 GMT", now) == 0.0
    assert parse_retry_after("Monday, 02-Jun-25 00:00:00 GMT", now) == pytest.approx(86400.0)


@pytest.mark.parametrize(
    "value",
    [
        "Sun Nov 31 08:49:37 1994",  # no such day
        "Sun Nov  6 25:49:37 1994",  # no such hour
        "Sun Nov  6 08:49:37 94",  # asctime has a four-digit year
        "Sun, 06 Nov 1994 08:49:37",  # no zone: none of the RFC's forms
    ],
)
def test_malformed_dates_are_none(value):
    assert parse_retry_after(value, RFC_EXAMPLE_EPOCH) is None

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

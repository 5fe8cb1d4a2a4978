"""The DLQ's pure rules: what is kept, what may be resent without a human, where a record
goes after a replay, and when the redrive runs again after a failure."""

from __future__ import annotations

import pytest

from sidecar.config.model import RetryPolicy
from sidecar.dlq.record import KeptBody, idempotency_key, safe_to_resend, storable_headers
from sidecar.dlq.redrive import MAX_BACKOFF, next_run
from sidecar.dlq.replay import next_status


async def _stream():
    yield b"x"


def test_kept_body_is_whole_or_nothing():
    assert KeptBody.of(None).data == b""  # no body at all
    assert KeptBody.of(b"abc").data == b"abc"
    assert KeptBody.of(_stream()).data is None  # streamed: never a stand-in


@pytest.mark.parametrize(
    ("method", "key", "reached", "mode", "safe"),
    [
        ("POST", None, False, "with-idempotency-key", True),  # nothing reached the upstream
        ("POST", None, True, "with-idempotency-key", False),
        ("POST", None, None, "with-idempotency-key", False),  # unknown counts as reached
        ("POST", "k", True, "with-idempotency-key", True),
        ("POST", "  ", True, "with-idempotency-key", False),  # a blank key is no key
        ("PATCH", None, True, "always", True),
        ("POST", "k", True, "never", False),  # the route's rule, as for live retries
        ("PUT", None, True, "never", True),  # idempotent methods
        ("DELETE", None, None, "never", True),
    ],
)
def test_safe_to_resend(method, key, reached, mode, safe):
    policy = RetryPolicy(non_idempotent=mode)
    assert safe_to_resend(policy, method, key, reached) is safe


def test_idempotency_key_and_stored_headers():
    headers = [
        (b"Idempotency-Key", b"  "),
        (b"idempotency-key", b" k-2 "),
        (b"Authorization", b"Bearer s"),
        (b"X-Api-Key", b"s"),
        (b"Content-Length", b"3"),
        (b"X-Tenant", b"acme"),
    ]
    assert idempotency_key(headers) == "k-2"
    assert idempotency_key([(b"Idempotency-Key", b"")]) is None
    kept = storable_headers(headers, keep_credentials=False, drop=frozenset({"x-api-key"}))
    assert [k for k, _ in kept] == ["Idempotency-Key", "idempotency-key", "X-Tenant"]
    kept = storable_headers(headers, keep_credentials=True)
    assert "Authorization" in [k for k, _ in kept]


def test_next_status():
    assert next_status(204, 1, 5) == ("delivered", None)
    assert next_status(302, 9, 5) == ("delivered", None)
    assert next_status(422, 1, 5) == ("parked", "the upstream answered 422")
    assert next_status(503, 4, 5) == ("pending", None)
    assert next_status(None, 4, 5) == ("pending", None)
    assert next_status(503, 5, 5) == ("parked", "max_replays (5) reached")


def test_next_run_backs_off_after_failures():
    assert next_run(100.0, 30.0, 0) == 130.0
    assert next_run(100.0, 1.0, 1) == 102.0
    assert next_run(100.0, 1.0, 3) == 108.0
    assert next_run(100.0, 30.0, 20) == 100.0 + MAX_BACKOFF
    assert next_run(100.0, 600.0, 5) == 700.0  # never sooner than the interval


def test_reopen_delay_backs_off_to_its_bound():
    from sidecar.dlq.reopen import FIRST, MAX, reopen_delay

    delays = [reopen_delay(n) for n in range(1, 12)]
    assert delays[0] == FIRST and delays[1] == 2 * FIRST
    assert delays == sorted(delays) and delays[-1] == MAX
    assert reopen_delay(10**6) == MAX  # no overflow after a long outage


def test_only_damage_moves_a_file_aside():
    import sqlite3

    from sidecar.dlq.dbfile import damaged

    def err(code: int) -> sqlite3.DatabaseError:
        exc = sqlite3.DatabaseError("x")
        exc.sqlite_errorcode = code  # type: ignore[attr-defined]
        return exc

    assert damaged(err(11)) and damaged(err(26)) and damaged(err(11 | (1 << 8)))
    # SQLITE_IOERR (and its extended codes), SQLITE_FULL, SQLITE_CANTOPEN, SQLITE_BUSY: no.
    assert not any(damaged(err(c)) for c in (10, 10 | (18 << 8), 13, 14, 5, 6))
    assert not damaged(sqlite3.DatabaseError("no code"))

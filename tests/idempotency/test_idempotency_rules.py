"""The pure rules of effectively-once writes: the key, the fingerprint, the decision, kept or
released, and the problem answers."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sidecar.engine.answered import Answered, client_gone
from sidecar.idempotency import problem
from sidecar.idempotency.answer import Answer, Forwarded, forwarded_of, not_begun
from sidecar.idempotency.decision import Decision, KeyState, decide, retry_after
from sidecar.idempotency.fingerprint import NO_SCOPE, fingerprint, scope_digest, stored_key
from sidecar.idempotency.keep import Disposition, KeptAnswer, dispose, kept, replay
from sidecar.idempotency.key import BadKey, GoodKey, NoKey, parse_key, parse_value
from sidecar.idempotency.policy import IdempotencyPolicy

KEY_CASES = [
    (b"abc", GoodKey("abc")),
    (b'"abc"', GoodKey("abc")),  # the draft's sf-string names the same key as the bare form
    (b"8e03978e-40d5-43e8-bc93-6894a57f9324", GoodKey("8e03978e-40d5-43e8-bc93-6894a57f9324")),
    (b'"a\\"b\\\\c"', GoodKey('a"b\\c')),  # sf-string escapes
    (b"k" * 255, GoodKey("k" * 255)),
    (b"", "empty"),
    (b'""', "empty"),
    (b"k" * 256, "longer than 255 characters"),
    (b'"' + b"k" * 256 + b'"', "longer than 255 characters"),
    (b"a b", "not a visible ASCII string"),
    (b'"a b"', "not a visible ASCII string"),
    (b"caf\xe9", "not a visible ASCII string"),
    (b"a\tb", "not a visible ASCII string"),
    (b'"abc', "not a valid quoted string (RFC 8941 sf-string)"),
    (b'"a\\nb"', "not a valid quoted string (RFC 8941 sf-string)"),  # only \" and \\ escape
    (b'"a"b"', "not a valid quoted string (RFC 8941 sf-string)"),
    (b'"abc";p=1', "not a valid quoted string (RFC 8941 sf-string)"),  # no parameters
]


@pytest.mark.parametrize(("raw", "want"), KEY_CASES)
def test_key_forms(raw: bytes, want: object) -> None:
    got = parse_value(raw)
    if isinstance(want, GoodKey):
        assert got == want
    else:
        assert isinstance(got, BadKey) and got.reason == want


def test_key_from_headers() -> None:
    assert parse_key([(b"Host", b"x")]) == NoKey()
    assert parse_key([(b"IDEMPOTENCY-KEY", b"k1")]) == GoodKey("k1")
    two = parse_key([(b"Idempotency-Key", b"a"), (b"idempotency-key", b"b")])
    assert isinstance(two, BadKey) and "more than one" in two.reason
    shown = parse_value(b"x" * 10_000)
    assert isinstance(shown, BadKey) and len(shown.raw) == 255


@given(
    st.text(
        alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=255
    )
)
def test_every_visible_ascii_key_reads_the_same_bare_and_quoted(key: str) -> None:
    quoted = '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    assert parse_value(quoted.encode()) == GoodKey(key)
    if not key.startswith('"'):
        assert parse_value(key.encode()) == GoodKey(key)


@given(st.binary(max_size=300))
def test_any_bytes_give_a_key_or_a_reason(raw: bytes) -> None:
    got = parse_value(raw)
    if isinstance(got, GoodKey):
        assert 1 <= len(got.value) <= 255 and all(0x21 <= ord(c) <= 0x7E for c in got.value)
    else:
        assert isinstance(got, BadKey) and got.reason and len(got.raw) <= 255


def test_fingerprint_covers_method_target_body_and_scope() -> None:
    base = fingerprint("POST", b"/orders", b"{}", NO_SCOPE)
    assert base == fingerprint("POST", b"/orders", b"{}", NO_SCOPE)
    others = {
        fingerprint("PATCH", b"/orders", b"{}", NO_SCOPE),
        fingerprint("POST", b"/orders?x=1", b"{}", NO_SCOPE),
        fingerprint("POST", b"/orders", b"{ }", NO_SCOPE),
        fingerprint(
            "POST", b"/orders", b"{}", scope_digest([(b"Authorization", b"a")], "authorization")
        ),
        # length-prefixed parts: moving a byte from target to method is another request
        fingerprint("POS", b"T/orders", b"{}", NO_SCOPE),
    }
    assert base not in others and len(others) == 5


def test_scope_digest_separates_clients_and_hides_the_value() -> None:
    assert scope_digest([(b"Authorization", b"Bearer a")], None) == NO_SCOPE
    a = scope_digest([(b"Authorization", b"Bearer a")], "Authorization")
    b = scope_digest([(b"authorization", b"Bearer b")], "authorization")
    absent = scope_digest([], "Authorization")
    empty = scope_digest([(b"Authorization", b"")], "Authorization")
    assert len({a, b, absent, empty}) == 4
    assert "Bearer" not in a
    assert stored_key("k", a, "orders") != stored_key("k", b, "orders")


@pytest.mark.parametrize("name", ["Authorization", "Proxy-Authorization"])
def test_credentials_scope_by_client_whatever_the_scheme_is_spelled(name: str) -> None:
    """The auth-scheme is case-insensitive and 1*SP separates it (RFC 9110 11.1, 11.4): the
    same credentials spelled otherwise are the same client; the credentials themselves and
    every other header are taken as sent."""
    h = name.encode()

    def scope(value: bytes, header: bytes = h) -> str:
        return scope_digest([(header, value)], name)

    same = {scope(v) for v in (b"Bearer tok", b"bearer tok", b"BEARER  tok", b" Bearer\ttok ")}
    assert len(same) == 1
    assert scope(b"Bearer TOK") not in same  # the token68 is case-sensitive
    assert scope(b"Bearer") == scope(b"bearer ")
    other = scope_digest([(b"X-Client", b"Bearer tok")], "X-Client")
    assert other != scope_digest([(b"X-Client", b"bearer tok")], "X-Client")


NOW = 1_000.0
FP, OTHER = "fp", "other"
DECIDE_CASES = [
    (None, FP, Decision.FIRST),
    (KeyState(True, FP, NOW + 10), FP, Decision.REPLAYED),
    (KeyState(True, FP, NOW + 10), OTHER, Decision.MISMATCH),
    (KeyState(True, FP, NOW), FP, Decision.FIRST),  # its ttl passed: gone
    (KeyState(True, FP, NOW - 1), OTHER, Decision.FIRST),
    (KeyState(False, FP, NOW + 10), FP, Decision.IN_PROGRESS),
    (KeyState(False, FP, NOW + 10), OTHER, Decision.MISMATCH),
    (KeyState(False, FP, NOW), FP, Decision.LEASE_EXPIRED),
    (KeyState(False, FP, NOW - 100), FP, Decision.LEASE_EXPIRED),
    (KeyState(False, FP, NOW - 100), OTHER, Decision.MISMATCH),
]


@pytest.mark.parametrize(("state", "fp", "want"), DECIDE_CASES)
def test_decide(state: KeyState | None, fp: str, want: Decision) -> None:
    assert decide(state, fp, NOW) is want


@pytest.mark.parametrize(
    ("expiry", "want"), [(NOW + 30, 30), (NOW + 0.2, 1), (NOW + 1.5, 2), (NOW - 5, 1)]
)
def test_retry_after_is_the_remaining_lease_at_least_one_second(expiry: float, want: int) -> None:
    assert retry_after(expiry, NOW) == want


H = ((b"Content-Type", b"application/json"), (b"Content-Length", b"2"), (b"Connection", b"close"))
DISPOSE_CASES = [
    (Forwarded(201, H, b"ok", retryable=False), Disposition.KEEP),
    (Forwarded(500, H, b"ok", retryable=False), Disposition.KEEP),  # not in retry_on: kept
    (Forwarded(503, H, b"ok", retryable=True), Disposition.RELEASE),
    (Forwarded(502, (), b"", retryable=True), Disposition.RELEASE),  # made by the sidecar
    (Forwarded(200, H, b"x" * 11, retryable=False), Disposition.KEEP_STATUS),
    (Forwarded(200, H, b"x" * 10, retryable=False), Disposition.KEEP),
    (Forwarded(200, H, None, retryable=False), Disposition.KEEP_STATUS),  # streamed
    (Forwarded(503, H, None, retryable=True), Disposition.RELEASE),
]


RETRY_STATUSES = frozenset({502, 503, 504})
J = ((b"Content-Type", b"application/json"),)
# The request path's one outcome (engine/answered.py), as the guard reads it: released (True)
# or kept (False). Every kind of answer the path makes is a row.
ANSWERED_CASES = [
    ("app-201", Answered(201, J, "success", 1, body=b"ok", from_upstream=True), False),
    ("app-201-streamed", Answered(201, J, "success", 1, from_upstream=True), False),
    ("app-503-in-retry-on", Answered(503, J, "exhausted", 3, from_upstream=True), True),
    ("app-500-not-in-retry-on", Answered(500, J, "not-retryable", 1, from_upstream=True), False),
    ("app-429-not-begun", Answered(429, J, "not-retryable", 1, from_upstream=True), True),
    (
        "app-400-retry-after-not-begun",
        Answered(400, (*J, (b"Retry-After", b"3")), "not-retryable", 1, from_upstream=True),
        True,
    ),
    (
        "inner-sidecar-502",
        Answered(502, J, "exhausted", 1, from_upstream=True, upstream_error=b"connect-failure"),
        True,
    ),
    (
        "app-503-dlq-stored",
        Answered(503, J, "exhausted", 3, from_upstream=True, dlq="stored", dlq_id="r1"),
        False,
    ),
    (
        "app-503-dlq-full",
        Answered(503, J, "exhausted", 3, from_upstream=True, dlq="full"),
        True,
    ),
    (
        "app-body-broken",
        Answered(200, J, "body-broken", 1, from_upstream=True, proxy_error="reset"),
        False,
    ),
    ("own-connect-failure", Answered(502, J, "exhausted", 3, proxy_error="connect-failure"), True),
    ("own-breaker-open", Answered(503, J, "breaker-open", 0, proxy_error="breaker-open"), True),
    ("own-bad-response", Answered(502, J, "exhausted", 1, proxy_error="bad-response"), False),
    (
        "own-failure-dlq-stored",
        Answered(502, J, "exhausted", 3, proxy_error="connect-failure", dlq="stored", dlq_id="r1"),
        False,
    ),
    ("own-dlq-202", Answered(202, J, "exhausted", 3, dlq="stored", dlq_id="r1"), False),
]


@pytest.mark.parametrize(
    ("answered", "released"),
    [(a, want) for _, a, want in ANSWERED_CASES],
    ids=[name for name, _, _ in ANSWERED_CASES],
)
def test_the_guard_reads_the_paths_outcome(answered: Answered, released: bool) -> None:
    """What the guard judges is read from the path's outcome itself: whether the DLQ stored
    the write (its record id), a sidecar's own answer (this one's, or one further down), never
    a header the proxy set. Status, fields and body are the answer's."""
    got = forwarded_of(answered, RETRY_STATUSES)
    assert got.retryable is released
    assert (got.status, got.headers, got.body) == (answered.status, answered.headers, answered.body)


def test_the_outcome_is_made_anew_never_changed() -> None:
    """Its fields are ``Final`` (mypy holds every writer to that): a later fact, the bytes a
    held answer sent once released, makes a new one."""
    answered = client_gone()
    assert (answered.status, answered.fate, answered.attempts) == (499, "client-gone", 0)
    sent = answered.with_sent(7)
    assert sent.sent == 7 and answered.sent == 0 and sent is not answered


@pytest.mark.parametrize(("forwarded", "want"), DISPOSE_CASES)
def test_kept_or_released(forwarded: Forwarded, want: Disposition) -> None:
    assert dispose(forwarded, max_response_bytes=10) is want


@pytest.mark.parametrize(
    ("status", "headers", "want"),
    [
        (429, (), True),
        (408, (), True),
        (425, (), True),
        (409, ((b"retry-after", b"2"),), True),
        (500, ((b"Retry-After", b"Wed, 21 Oct 2015 07:28:00 GMT"),), True),
        (409, (), False),
        (201, (), False),
        (202, ((b"Retry-After", b"5"),), False),  # accepted, poll later: the app acted
        (303, ((b"Retry-After", b"5"),), False),
    ],
)
def test_answers_before_the_app_began_release(
    status: int, headers: tuple[tuple[bytes, bytes], ...], want: bool
) -> None:
    assert not_begun(status, headers) is want


def test_a_kept_answer_replays_without_framing_and_says_so() -> None:
    fwd = Forwarded(201, H, b"ok", retryable=False)
    answer = kept(fwd, Disposition.KEEP)
    assert answer == KeptAnswer(201, ((b"Content-Type", b"application/json"),), b"ok")
    out = replay("k1", answer)
    assert (out.status, out.body) == (201, b"ok")
    assert out.header(b"idempotent-replayed") == b"true"
    assert out.header(b"content-length") is None


def test_an_answer_too_large_replays_its_status_and_a_problem() -> None:
    answer = kept(Forwarded(201, H, b"x" * 11, retryable=False), Disposition.KEEP_STATUS)
    assert answer == KeptAnswer(201, (), None, 11)
    out = replay("k1", answer)
    assert out.status == 201 and out.header(b"idempotent-replayed") == b"true"
    assert out.header(b"content-type") == b"application/problem+json"
    assert json.loads(out.body)["type"].endswith(":answer-not-kept")


@pytest.mark.parametrize(
    ("made", "status"),
    [
        (problem.missing_key(), 400),
        (problem.invalid_key("empty", ""), 400),
        (problem.in_progress("k1", 7), 409),
        (problem.mismatch("k1"), 422),
        (problem.store_unavailable("k1"), 503),
    ],
)
def test_problem_answers_are_rfc9457(made: Answer, status: int) -> None:
    assert made.status == status
    assert made.header(b"content-type") == b"application/problem+json"
    doc = json.loads(made.body)
    assert set(doc) == {"type", "title", "status", "detail", "key"}
    assert doc["status"] == status and doc["type"].startswith("urn:retry-sidecar:problem:")
    if status == 409:
        assert made.header(b"retry-after") == b"7"


def test_policy_lease_defaults_to_route_timeout_plus_5s() -> None:
    assert IdempotencyPolicy().lease_for(60.0) == 65.0
    assert IdempotencyPolicy(lease=3.0).lease_for(60.0) == 3.0
    assert not IdempotencyPolicy().guards("POST")  # disabled by default
    assert IdempotencyPolicy(enabled=True).guards("PATCH")
    assert not IdempotencyPolicy(enabled=True).guards("GET")

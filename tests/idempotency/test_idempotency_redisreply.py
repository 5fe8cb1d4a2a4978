"""The shape of the fleet Redis's replies to the idempotency store, and Redis's clock seen from
here (``sidecar/idempotency/redisreply.py``): pure."""

from __future__ import annotations

import pytest

from sidecar.fleet.connection import BadReply
from sidecar.idempotency import redisreply as r


@pytest.mark.parametrize(
    "reply",
    [
        b"OK",
        1,
        [1],
        [1, 1],
        [7, b"1.5"],
        [0, b"1.5"],
        [1, b"1.5", []],
        [0, b"1.5", [b"a"]],
        [0, b"1.5", [1, 2]],
        [1, b"nan"],
        [1, b"soon"],
        [True, b"1.5"],
    ],
)
def test_a_claim_reply_of_the_wrong_shape_is_a_bad_reply(reply: object) -> None:
    with pytest.raises(BadReply):
        r.claim_reply(reply)


def test_claim_replies_that_fit() -> None:
    assert r.claim_reply([1, b"1.5"]) == r.ClaimReply(1, 1.5, None)
    assert r.claim_reply([3, b"2"]) == r.ClaimReply(3, 2.0, None)
    got = r.claim_reply([0, b"1.5", [b"finished", b"1"]])
    assert got.fields == {b"finished": b"1"}


@pytest.mark.parametrize("reply", [b"OK", 2, -1, [1], True])
def test_a_flag_is_zero_or_one(reply: object) -> None:
    with pytest.raises(BadReply):
        r.flag(reply, "a keep")
    assert r.flag(1, "x") and not r.flag(0, "x")


def test_reading_any_reply_wrongly_is_a_bad_reply() -> None:
    with pytest.raises(BadReply, match="TIME"), r.checking("TIME"):
        int(b"O"[0:0])
    with pytest.raises(BadReply):
        r.hash_fields({79: 75}, "HGETALL")
    with pytest.raises(BadReply):
        r.redis_time(b"OK")
    assert r.redis_time((5, 250_000)) == 5.25


def test_the_clock_keeps_the_largest_estimate_and_follows_a_step_back() -> None:
    clock = r.RedisClock()
    assert clock.deadline(10.0) == ""  # unknown: no deadline
    clock.learn(1000.0, 10.0)  # offset 990
    clock.learn(1000.5, 11.0)  # a slower reply: 989.5, kept out
    assert clock.offset == 990.0
    assert clock.deadline(12.0) == "1002.000000"
    clock.learn(1001.2, 11.0)  # closer: 990.2
    assert clock.offset == pytest.approx(990.2)
    clock.learn(500.0, 12.0)  # Redis's clock stepped back: start again from it
    assert clock.offset == 488.0

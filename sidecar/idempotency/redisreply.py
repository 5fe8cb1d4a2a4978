"""What the fleet's Redis answers the idempotency store, checked for shape before anything is
read from it, and Redis's clock as seen from this sidecar. Pure.

Shape: a reply that does not fit its command (another server on Redis's port, a proxy in
between, a damaged key) is a ``BadReply``: a failure of the link like a timeout, so the route's
``on_store_error`` applies and the fleet view shows the link down with the error, never a
traceback. ``SHAPE_ERRORS`` are what reading such a reply raises anywhere else (redis-py's own
reply callbacks included): ``checking`` turns them into a ``BadReply`` too.

Clock: a claim may reach Redis after the sidecar gave up on it (a stalled Redis that resumes),
and would then hold a key nobody owns. So each claim carries a deadline on Redis's clock past
which the script refuses itself. ``RedisClock`` maps this sidecar's monotonic clock onto
Redis's (``TIME``) from the replies that carry Redis's ``now``: each reply gives ``redis_now -
local_now`` at its receipt, which is at most the true offset (the reply left Redis before it
arrived), so the largest estimate is the closest, and a deadline mapped with it falls at or
before the sidecar's own: a claim never lands after the sidecar refused the write.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from sidecar.fleet.connection import BadReply

# What reading a reply of the wrong shape raises (ours and redis-py's reply callbacks).
SHAPE_ERRORS = (ValueError, TypeError, IndexError, KeyError, AttributeError, UnicodeDecodeError)
# An estimate this far below the best one is a step back of Redis's clock, not a slow reply
# (a reply is read within the link's timeout of its sending): start again from it.
STEP_BACK = 1.0


@contextlib.contextmanager
def checking(what: str) -> Iterator[None]:
    """Reading a reply to ``what``: whatever its shape makes fail is a ``BadReply``."""
    try:
        yield
    except SHAPE_ERRORS as exc:
        raise BadReply(f"Redis answered {what} with a reply of the wrong shape ({exc})") from None


def number(value: object) -> float:
    """A finite decimal as Redis or a script writes it (bytes or str)."""
    if isinstance(value, bytes):
        value = value.decode("ascii")
    if not isinstance(value, str):
        raise TypeError(f"expected a decimal, got {type(value).__name__}")
    got = float(value)
    if not math.isfinite(got):
        raise ValueError(f"not a finite decimal: {value!r}")
    return got


def flag(reply: object, what: str) -> bool:
    """A script's or command's 0 / 1 answer."""
    if type(reply) is not int or reply not in (0, 1):
        raise BadReply(f"Redis answered {what} with {_shown(reply)}, not 0 or 1")
    return reply == 1


def pairs(flat: object, what: str) -> dict[bytes | str, bytes | str]:
    """A hash as a script answers it (``HGETALL`` inside Lua: name, value, name, value...)."""
    if not isinstance(flat, list) or len(flat) % 2 or not all(isinstance(v, bytes) for v in flat):
        raise BadReply(f"Redis answered {what} with {_shown(flat)}, not a hash's fields")
    return dict(zip(flat[::2], flat[1::2], strict=True))


def hash_fields(got: object, what: str) -> Mapping[bytes | str, bytes | str]:
    """``HGETALL``'s answer as redis-py gives it: a dict of bytes."""
    if not isinstance(got, dict) or not all(
        isinstance(k, bytes) and isinstance(v, bytes) for k, v in got.items()
    ):
        raise BadReply(f"Redis answered {what} with {_shown(got)}, not a hash")
    return got


@dataclass(frozen=True, slots=True)
class ClaimReply:
    code: int  # 0: judge ``fields``; 1, 2: claimed; 3: refused past its deadline; 4: judge
    # ``fields``, the legacy name's
    now: float  # Redis's clock when the script ran
    fields: dict[bytes | str, bytes | str] | None  # codes 0 and 4 only


CLAIM_CODES = (0, 1, 2, 3, 4)
JUDGE_CODES = (0, 4)


def claim_reply(reply: object) -> ClaimReply:
    """The claim script's answer: ``{code, now}`` or ``{0 or 4, now, fields}``."""
    shape = f"{_shown(reply)}, not a claim's answer"
    if not isinstance(reply, list) or len(reply) not in (2, 3):
        raise BadReply(f"Redis answered a claim with {shape}")
    code = reply[0]
    if (
        type(code) is not int
        or code not in CLAIM_CODES
        or (len(reply) == 3) != (code in JUDGE_CODES)
    ):
        raise BadReply(f"Redis answered a claim with {shape}")
    with checking("a claim"):
        now = number(reply[1])
    fields = pairs(reply[2], "a claim") if code in JUDGE_CODES else None
    return ClaimReply(code, now, fields)


def redis_time(reply: object) -> float:
    """``TIME`` as redis-py gives it: (seconds, microseconds)."""
    if (
        not isinstance(reply, tuple | list)
        or len(reply) != 2
        or not all(type(v) is int and v >= 0 for v in reply)
    ):
        raise BadReply(f"Redis answered TIME with {_shown(reply)}")
    return float(reply[0]) + float(reply[1]) / 1_000_000


def _shown(reply: object) -> str:
    text = repr(reply)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(slots=True)
class RedisClock:
    """Redis's clock seen from this sidecar's monotonic clock: the best (largest) estimate of
    ``redis_now - local_now`` so far, None before the first."""

    offset: float | None = None

    def learn(self, redis_now: float, local_now: float) -> None:
        """A reply carrying Redis's ``now``, received at ``local_now``."""
        estimate = redis_now - local_now
        if self.offset is None or estimate > self.offset or estimate < self.offset - STEP_BACK:
            self.offset = estimate

    def deadline(self, local_deadline: float) -> str:
        """``local_deadline`` (monotonic) on Redis's clock as a script reads it; '' while
        unknown (no deadline)."""
        if self.offset is None:
            return ""
        return f"{local_deadline + self.offset:.6f}"

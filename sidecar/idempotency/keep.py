"""Kept or released: what becomes of a claimed key once the app answered, and what a later
duplicate gets. Pure.

- An answer the route would retry (a status in ``retry_on``, a connect failure, a reset, a
  timeout, an answer the sidecar made itself before the app answered) or one that says the
  app did not begin (408, 425, 429, an error with ``Retry-After``) releases the key, so the
  client's retry runs. An answer the sidecar made because the app's own could not be relayed
  (``bad-response``: the app acted) is kept like the app's.
- Any other answer is kept for ``ttl``: status, end-to-end headers and body.
- An answer larger than ``max_response_bytes`` (or streamed without being held) is relayed,
  not kept, but the key is still finished: the write took effect and must not run again. A
  later duplicate gets the original status with ``Idempotent-Replayed: true`` and a problem
  body (``answer-not-kept``) saying the answer was too large to keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from sidecar.idempotency import problem
from sidecar.idempotency.answer import Answer, Forwarded, Headers, kept_headers

REPLAYED_HEADER = (b"Idempotent-Replayed", b"true")


class Disposition(StrEnum):
    KEEP = "keep"  # finished, the whole answer kept
    KEEP_STATUS = "keep-status"  # finished, the answer too large: only its status kept
    RELEASE = "release"  # the route would retry it: the key is let go


@dataclass(frozen=True, slots=True)
class KeptAnswer:
    status: int
    headers: Headers
    body: bytes | None  # None: the answer was too large to keep
    size: int | None = None  # the body's size when it was not kept (None: unknown, streamed)


def dispose(forwarded: Forwarded, max_response_bytes: int) -> Disposition:
    if forwarded.retryable:
        return Disposition.RELEASE
    if forwarded.body is None or len(forwarded.body) > max_response_bytes:
        return Disposition.KEEP_STATUS
    return Disposition.KEEP


def kept(forwarded: Forwarded, disposition: Disposition) -> KeptAnswer:
    if disposition is Disposition.KEEP and forwarded.body is not None:
        return KeptAnswer(forwarded.status, kept_headers(forwarded.headers), forwarded.body)
    size = len(forwarded.body) if forwarded.body is not None else None
    return KeptAnswer(forwarded.status, (), None, size)


def without_body(answer: KeptAnswer) -> KeptAnswer:
    """``answer`` kept as one too large to keep is (status and size, no headers nor body): what a
    store keeps when the whole answer would put it past its bound (``idempotency.max_bytes``,
    a Redis at its ``maxmemory``). A duplicate gets the ``answer-not-kept`` replay."""
    size = len(answer.body) if answer.body is not None else answer.size
    return KeptAnswer(answer.status, (), None, size)


def replay(key: str, answer: KeptAnswer) -> Answer:
    if answer.body is None:
        made = problem.answer_not_kept(key, answer.status)
        return Answer(made.status, (*made.headers, REPLAYED_HEADER), made.body)
    # One Idempotent-Replayed: a kept answer that was itself a replay (an inner sidecar's)
    # does not carry a second.
    name = REPLAYED_HEADER[0].lower()
    headers = tuple((k, v) for k, v in answer.headers if k.lower() != name)
    return Answer(answer.status, (*headers, REPLAYED_HEADER), answer.body)

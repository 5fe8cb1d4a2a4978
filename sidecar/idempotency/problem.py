"""The sidecar's own idempotency answers: RFC 9457 ``application/problem+json`` with ``type``,
``title``, ``status``, ``detail`` and the key. They never reach the app."""

from __future__ import annotations

import json

from sidecar.idempotency.answer import Answer, Headers

CONTENT_TYPE = b"application/problem+json"
TYPE_BASE = "urn:retry-sidecar:problem:idempotency:"


def problem(
    status: int, kind: str, title: str, detail: str, key: str | None, extra: Headers = ()
) -> Answer:
    doc = {
        "type": TYPE_BASE + kind,
        "title": title,
        "status": status,
        "detail": detail,
        "key": key,
    }
    body = json.dumps(doc, ensure_ascii=True).encode("ascii")
    return Answer(status, ((b"Content-Type", CONTENT_TYPE), *extra), body)


def missing_key() -> Answer:
    return problem(
        400,
        "key-missing",
        "Idempotency-Key required",
        "This route requires an Idempotency-Key header on this method.",
        None,
    )


def invalid_key(reason: str, raw: str) -> Answer:
    return problem(
        400,
        "key-invalid",
        "Malformed Idempotency-Key",
        f"The Idempotency-Key is {reason}: it must be 1 to 255 visible ASCII characters, "
        'bare or as a quoted string ("...").',
        raw,
    )


def in_progress(key: str, seconds: int) -> Answer:
    return problem(
        409,
        "in-progress",
        "Request with this Idempotency-Key in progress",
        "A request with this key is being processed; retry after the time given.",
        key,
        ((b"Retry-After", str(seconds).encode("ascii")),),
    )


def mismatch(key: str) -> Answer:
    return problem(
        422,
        "key-reused",
        "Idempotency-Key reused for another request",
        "This key was used for a request with another method, target or body.",
        key,
    )


def store_unavailable(key: str) -> Answer:
    return problem(
        503,
        "store-unavailable",
        "Idempotency store unavailable",
        "The keys cannot be checked now, so the write was not sent; retry later.",
        key,
    )


def answer_not_kept(key: str, status: int) -> Answer:
    """The replay of an answer that was larger than ``max_response_bytes`` (or would have put
    the store past its bound): the write took effect once, with the original status; its body
    was relayed then and not kept."""
    return problem(
        status,
        "answer-not-kept",
        "Answer not kept",
        "The request with this key was already processed; its answer was not kept (too large, or "
        "the store was full), "
        "so only its status is replayed.",
        key,
    )


def body_too_large(key: str | None, limit: int) -> Answer:
    """413: a guarded write whose body is larger than the route buffers (``retry.max_body_bytes``)
    cannot be fingerprinted, so it is not sent."""
    return problem(
        413,
        "body-too-large",
        "Request body too large to guard",
        f"A write on this route is checked against its Idempotency-Key by a digest of its whole "
        f"body, which the sidecar buffers up to {limit} bytes (the route's "
        "retry.max_body_bytes); this body is larger, so it was not sent.",
        key,
    )

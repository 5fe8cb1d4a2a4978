"""The top-level ``limits:`` section: the bounds on what a client may send and how long it may
take. Declared once here (``sidecar/config/schema.py``); the proxy's server reads it."""

from __future__ import annotations

from dataclasses import dataclass

from sidecar.config import checks as c
from sidecar.config.schema import key
from sidecar.config.units import MAX_SIZE

# ``unlimited`` where a size may be: the largest size a config can hold.
UNLIMITED_SIZE = MAX_SIZE


@dataclass(frozen=True, slots=True)
class Limits:
    max_header_bytes: int = key(
        32 * 1024, c.size, unit="size", help="request line plus headers; 431 beyond"
    )
    header_timeout: float = key(
        10.0,
        c.positive_duration,
        unit="duration",
        help=(
            "a request head must arrive within this: a connection's first from accept (one "
            "that sends nothing is closed), a later one from its first byte; 408 otherwise"
        ),
    )
    body_idle_timeout: float = key(
        30.0,
        c.positive_duration,
        unit="duration",
        help=(
            "a request body that sends nothing for this long gets 408 (and its upstream "
            "request is aborted)"
        ),
    )
    # A client connection idle between requests is closed after this (nginx's default is 75 s;
    # aiohttp's own is an hour). Each idle connection costs ~10 KB here. Given to aiohttp's
    # server at start.
    keepalive_timeout: float = key(
        75.0,
        c.positive_duration,
        unit="duration",
        live=False,
        note="idle client connections are closed after this",
        help=(
            "a client connection idle between requests is closed after this (aiohttp's own "
            "default is an hour; each idle connection costs ~10 KB). Changes need a restart"
        ),
    )
    # No limit by default (``unlimited``), as Envoy and Linkerd: bodies over the route's
    # retry.max_body_bytes are streamed, never held, so memory is bounded by what is buffered.
    # A 20 MiB git push or a 30 MiB package upload must pass as it does direct.
    max_request_body: int = key(
        UNLIMITED_SIZE,
        c.size_or_unlimited,
        unit="size",
        help=(
            "a size, or `unlimited`: a larger Content-Length gets 413 before any upstream call; "
            "a chunked body is cut with 413 when it crosses the limit. No limit by default, as "
            "Envoy and Linkerd (nginx's 1 MiB default is set per app; a sidecar must pass a 20 "
            "MiB `git push` or a 30 MiB package upload as direct): a body over "
            "`retry.max_body_bytes` is streamed, never held, so memory is bounded by what is "
            "buffered"
        ),
    )
    # A client that takes no response bytes for this long is cut, and everything its request
    # held (bulkhead slot, upstream connection, buffers) is given back (nginx's send_timeout).
    send_timeout: float = key(
        60.0,
        c.positive_duration,
        unit="duration",
        note="a client that takes no response bytes this long is cut",
        help=(
            "a client that takes no response bytes for this long (its socket buffer stays "
            "full) is cut, and everything its request held (bulkhead slot, upstream "
            "connection, buffers) is given back; as nginx's `send_timeout`, but measured as the "
            "time the connection stays unwritable"
        ),
    )


@dataclass(frozen=True, slots=True)
class Http2:
    """The top-level ``http2:`` section: what an HTTP/2 client connection is held to (the
    listener's HTTP/2 front end, ``proxy/h2conn.py``); read when a connection is accepted."""

    max_concurrent_streams: int = key(
        100,
        c.int_range(1, 10_000),
        note="advertised in SETTINGS; a stream over it is refused (REFUSED_STREAM)",
        help=(
            "streams one HTTP/2 client connection may have in flight, advertised as "
            "SETTINGS_MAX_CONCURRENT_STREAMS; one more is refused with RST_STREAM "
            "REFUSED_STREAM (not processed, safe to retry); a stream its client reset counts "
            "until its request has unwound. Applies to connections accepted after a reload"
        ),
    )

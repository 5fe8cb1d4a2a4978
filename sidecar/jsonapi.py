"""The admin API's JSON conventions: an endpoint another package adds, the error answer, and
how numbers and times are read and written. Shared by the admin listener (``admin/server.py``)
and the DLQ's endpoints (``dlq/admin.py``), which sit below the admin layer."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from aiohttp import web

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# Extra routes other features add (the DLQ): (method, path, handler, needs_token_even_for_GET).
ExtraRoute = tuple[str, str, Handler, bool]


def iso(epoch: float | None) -> str | None:
    if epoch is None:
        return None
    return (
        datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


def error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def whole_number(raw: str | None, max_digits: int = 18) -> int | None:
    """A query parameter as a whole number: ASCII digits only, at most ``max_digits`` of them
    (18 stays within SQLite's and every other 64-bit integer); None otherwise. ``str.isdigit``
    alone also accepts "²" and other digits int() refuses, and int() refuses more than
    4,300 digits."""
    if raw is None or not raw.isascii() or not raw.isdigit() or len(raw) > max_digits:
        return None
    return int(raw)


def loads_json(raw: bytes) -> object:
    """``json.loads``; a body nested deeper than the decoder recurses (60,000 ``[`` fit in
    the admin body limit) is a ValueError like any other bad JSON, not a RecursionError."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("it nests too deeply") from None

"""The ``h2`` and ``hpack`` packages with their per-frame and per-header debug work switched off.

Both do work on the hot path for log lines nobody reads: ``h2`` formats every frame it
receives (``repr(frame)``, for a trace log its default logger drops: about 8 frames and 30 us of
CPU per gRPC call, as a profile under load showed), and ``hpack`` asks the ``logging`` module
whether debug is on for every header it encodes or decodes (about 80 calls per gRPC call). The
sidecar never turns their debug logging on, so:

- ``repr`` inside ``h2.connection`` (its only use is that trace line) is a function that
  formats nothing; nothing else of ``h2`` or of the process changes;
- ``hpack``'s module loggers are replaced by one whose ``debug`` does nothing.

Called by both HTTP/2 sides (``proxy/h2limits.py``, ``upstream/h2link.py``) as they are
imported, before any connection is made. ``h2`` and ``hpack`` are pinned (requirements.lock);
a version that no longer has these names is left as it is.
"""

from __future__ import annotations

import h2.connection
import hpack.hpack
import hpack.table


def _unformatted(obj: object) -> str:
    return ""


class _NoDebug:
    """A logger whose ``debug`` drops its line at once (hpack only ever calls ``debug``)."""

    def debug(self, *args: object, **kwargs: object) -> None:
        return None


def quiet() -> None:
    """Switch the debug work off (idempotent)."""
    if hasattr(h2.connection, "H2Connection"):
        h2.connection.repr = _unformatted  # type: ignore[attr-defined]
    for module in (hpack.hpack, hpack.table):
        if hasattr(module, "log"):
            module.log = _NoDebug()  # type: ignore[attr-defined]

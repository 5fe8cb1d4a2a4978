"""How long to wait before trying again to open a DLQ file that could not be opened.

A file that cannot be opened for a reason other than damage (a full volume that cannot take the
``-shm``, an I/O error, a permission) is left where it is, and opening is tried again: first
after ``FIRST`` seconds, doubling up to ``MAX``. Pure; imported at start (no sqlite3 here).
"""

from __future__ import annotations

FIRST = 1.0
MAX = 30.0


def reopen_delay(failures: int) -> float:
    """The pause after the ``failures``-th failed opening in a row (1-based)."""
    return min(MAX, FIRST * 2.0 ** max(0, min(failures - 1, 16)))

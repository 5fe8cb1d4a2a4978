"""What the DLQ's store refuses with."""

from __future__ import annotations


class DlqError(Exception):
    header = "unavailable"  # the x-retry-dlq value a client is told


class DlqFull(DlqError):
    header = "full"


class DlqUnavailable(DlqError):
    header = "unavailable"


class ClaimRefused(Exception):
    """The record cannot be claimed (or purged) now; nothing was changed."""


class RecordNotFound(ClaimRefused):
    pass


class RecordDelivered(ClaimRefused):
    pass


class RecordBusy(ClaimRefused):
    """Another replay (in this process or another one sharing the file) holds the claim."""


class RecordNotInStatus(ClaimRefused):
    pass


# An operation refused this way rolls back alone; the rest of its group commits.
REFUSALS = (DlqFull, ClaimRefused)

"""Whether the fleet's Redis still holds what this sidecar's DLQ stored there: the DLQ's
epoch, for ``redisstore``.

A Redis can come back empty: restarted without its files, a failover to a replica that had
nothing, a ``FLUSHALL``. Its records are then gone without any command failing, as the SQLite
DLQ's file deleted under it would be. So the DLQ keeps an epoch in Redis,
``<key_prefix>dlq:meta:epoch``: a random value set (``SET NX``) by whichever sidecar finds it
missing, persisted like the records. Each sidecar remembers the epoch it first saw and reads
it again on every ``add`` (in the same script) and every counts read (``dlq-counts``, 2 s). A
different or missing epoch means the Redis lost the data this sidecar used: an ERROR line,
``dlq_file_recreated_total`` counted, the ``dlq_warning`` of the status page and ``GET /status``
set (until the process restarts), and the epoch set again. Every sidecar that knew the old epoch
reports it, each once (the counter and alert are per pod; nobody coordinates who reports).

The limit: a sidecar only compares with what it saw itself, so a Redis emptied while no
sidecar of the fleet runs, or before a sidecar's first call, goes unnoticed by that sidecar.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable

log = logging.getLogger("sidecar.dlq")

# KEYS[1]: the epoch key; ARGV[1]: a fresh random value, set when the key is missing.
# -> the epoch in force. (``redisscripts.ADD`` does the same before it stores a record.)
READ = """
local e = redis.call('GET', KEYS[1])
if not e then
  redis.call('SET', KEYS[1], ARGV[1])
  return ARGV[1]
end
return e
"""


def fresh() -> str:
    return secrets.token_hex(8)


def changed(known: str | None, seen: str) -> bool:
    """Whether the epoch seen differs from the one known (none known yet: it is adopted)."""
    return known is not None and known != seen


class Epoch:
    """The epoch this sidecar knows, and what it found when that one went missing."""

    def __init__(self, where: str, wall: Callable[[], float] = time.time) -> None:
        self.where = where
        self.known: str | None = None
        self.losses = 0
        self.note: str | None = None  # for the status page's DLQ warning
        self.on_lost: Callable[[], None] = lambda: None
        self._wall = wall

    def seen(self, value: str) -> bool:
        """The epoch read now; True when the Redis lost the data (said loudly, here)."""
        lost = changed(self.known, value)
        self.known = value
        if not lost:
            return False
        self.losses += 1
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self._wall()))
        self.note = (
            f"the fleet Redis lost the DLQ's data at about {stamp} (its epoch changed: "
            f"emptied, restarted without its files, or failed over to an empty replica); "
            f"records acknowledged before then may have been lost"
        )
        log.error(
            "DLQ on Redis %s: the DLQ's epoch changed, so the Redis lost its data (emptied, "
            "restarted without its files, or failed over to an empty replica); records "
            "acknowledged before then may have been lost (%d times so far)",
            self.where,
            self.losses,
        )
        self.on_lost()
        return True

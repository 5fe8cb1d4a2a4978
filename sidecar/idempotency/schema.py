"""The idempotency file's table. One row per key holds everything about it (state, claim,
answer), so a write of a key is one row: a crash leaves either no key or a whole one.

``idempotency_tally`` counts the keys and their bytes (``ROW_BYTES``: the key, fingerprint, kept
headers and body, plus a fixed overhead), kept exact by triggers in the same transaction as
every insert, update and delete, from any process sharing the file (a ``REPLACE`` fires the
delete trigger: ``recursive_triggers`` is on, ``sqlite.connect``). The claim of a new key reads
it against ``idempotency.max_records``/``max_bytes``."""

from __future__ import annotations

import contextlib
import sqlite3

SCHEMA_VERSION = 2
OVERHEAD = 64  # bytes counted per key beyond its texts and blobs (timestamps, page overhead)


def _size(row: str) -> str:
    return (
        f"(length({row}.key) + length({row}.fingerprint) + COALESCE(length({row}.headers), 0)"
        f" + COALESCE(length({row}.body), 0) + {OVERHEAD})"
    )


TALLY = (
    "CREATE TABLE IF NOT EXISTS idempotency_tally ("
    "id INTEGER PRIMARY KEY CHECK (id = 0), records INTEGER NOT NULL, bytes INTEGER NOT NULL)",
    "INSERT OR IGNORE INTO idempotency_tally (id, records, bytes) "
    f"SELECT 0, COUNT(*), COALESCE(SUM({_size('k')}), 0) FROM idempotency_keys AS k",
    "CREATE TRIGGER IF NOT EXISTS idempotency_tally_insert AFTER INSERT ON idempotency_keys "
    f"BEGIN UPDATE idempotency_tally SET records = records + 1, bytes = bytes + {_size('NEW')} "
    "WHERE id = 0; END",
    "CREATE TRIGGER IF NOT EXISTS idempotency_tally_delete AFTER DELETE ON idempotency_keys "
    f"BEGIN UPDATE idempotency_tally SET records = records - 1, bytes = bytes - {_size('OLD')} "
    "WHERE id = 0; END",
    "CREATE TRIGGER IF NOT EXISTS idempotency_tally_update AFTER UPDATE ON idempotency_keys "
    f"BEGIN UPDATE idempotency_tally SET bytes = bytes + {_size('NEW')} - {_size('OLD')} "
    "WHERE id = 0; END",
)
TABLE = """
CREATE TABLE IF NOT EXISTS idempotency_keys (
    key TEXT PRIMARY KEY,
    finished INTEGER NOT NULL,
    fingerprint TEXT NOT NULL,
    token TEXT,
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    status INTEGER,
    headers TEXT,
    body BLOB,
    size INTEGER
)
"""
# The client's key alone (the stored key after its scope and one space): how a scoped key is
# found by its key (``holders``). An index on an expression, so a store written before it
# needs no new column: the index is built over its rows when the file is opened.
BARE_KEY = "substr(key, instr(key, ' ') + 1)"
INDEXES = (
    "CREATE INDEX IF NOT EXISTS idempotency_keys_expiry ON idempotency_keys(finished, expires_at)",
    f"CREATE INDEX IF NOT EXISTS idempotency_keys_bare ON idempotency_keys({BARE_KEY})",
)


def migrate(conn: sqlite3.Connection) -> None:
    """Create the table on a connection in autocommit mode (idempotent, one transaction)."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(TABLE)
        for ddl in (*INDEXES, *TALLY):
            conn.execute(ddl)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise

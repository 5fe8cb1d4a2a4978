"""The idempotency file's table. One row per key holds everything about it (state, claim,
answer), so a write of a key is one row: a crash leaves either no key or a whole one."""

from __future__ import annotations

import contextlib
import sqlite3

SCHEMA_VERSION = 1
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
        for ddl in INDEXES:
            conn.execute(ddl)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise

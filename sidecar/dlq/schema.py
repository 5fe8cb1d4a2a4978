"""The DLQ file: its table, the migration of older files, and its permissions.

Migration is additive and idempotent, so a file written by any earlier version opens, and two
processes opening one file at once do not trip over each other (each step runs inside one
``BEGIN IMMEDIATE`` transaction and checks what is already there first).
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat

log = logging.getLogger("sidecar.dlq")

SCHEMA_VERSION = 2
BASE_TABLE = """
CREATE TABLE IF NOT EXISTS records (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    route TEXT NOT NULL,
    status TEXT NOT NULL,
    method TEXT NOT NULL,
    target TEXT NOT NULL,
    headers TEXT NOT NULL,
    body BLOB NOT NULL,
    fate TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    last_status INTEGER,
    last_error TEXT,
    idempotency_key TEXT,
    replays INTEGER NOT NULL DEFAULT 0,
    size INTEGER NOT NULL,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL
)
"""
# Added in schema 2; older files get them by ALTER TABLE (NULL in the rows already there).
ADDED_COLUMNS = (
    # 1: some byte may have reached the upstream; 0: none did; NULL: unknown (older record).
    ("reached_upstream", "INTEGER"),
    # The replay claim: who holds it and until when (epoch seconds); NULL when unclaimed.
    ("claimed_by", "TEXT"),
    ("claimed_at", "REAL"),
    ("claim_expires_at", "REAL"),
    # Why a record was parked, for the human who decides what to do with it.
    ("parked_reason", "TEXT"),
)
INDEXES = (
    "CREATE INDEX IF NOT EXISTS records_status_route ON records(status, route, seq)",
    # The oldest pending record, for the age gauge, in O(log n).
    "CREATE INDEX IF NOT EXISTS records_status_seq ON records(status, seq)",
)
FILE_MODE = 0o600
SUFFIXES = ("", "-wal", "-shm")


def migrate(conn: sqlite3.Connection) -> None:
    """Create or upgrade the table on a connection in autocommit mode."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        conn.execute(BASE_TABLE)
        have = {row[1] for row in conn.execute("PRAGMA table_info(records)")}
        for name, kind in ADDED_COLUMNS:
            if name not in have:
                conn.execute(f"ALTER TABLE records ADD COLUMN {name} {kind}")
        for ddl in INDEXES:
            conn.execute(ddl)
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise


def prepare_private_file(path: str) -> None:
    """Create the DLQ file owner-only (0600) before SQLite opens it; SQLite then creates the
    ``-wal`` and ``-shm`` files with the database file's permissions. An existing file (or its
    ``-wal``/``-shm``) readable by others is tightened to 0600, with a warning: records hold
    request bodies and headers."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, mode=0o700, exist_ok=True)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
    except FileExistsError:
        pass
    else:
        os.close(fd)
    for suffix in SUFFIXES:
        p = path + suffix
        try:
            mode = stat.S_IMODE(os.stat(p).st_mode)
        except FileNotFoundError:
            continue
        if mode & 0o077:
            try:
                os.chmod(p, FILE_MODE)
            except OSError as exc:
                log.warning("DLQ file %s is mode %o and could not be made 0600: %s", p, mode, exc)
            else:
                log.warning("DLQ file %s was mode %o; made it 0600", p, mode)

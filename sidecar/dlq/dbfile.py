"""The DLQ's SQLite file on disk: a connection with the pragmas every one of ours gets, the
integrity check that moves a damaged file aside, which file is at the path (so a deleted or
replaced one is noticed), and a copy of an open database written back to the path.

What ``schema`` leaves to others: it makes the table and the permissions; this module judges
and handles the file as a whole. No state: ``DlqStore`` decides what to do with the answers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import time

from sidecar.dlq import schema

log = logging.getLogger("sidecar.dlq")

CORRUPT_CODES = (11, 26)  # SQLITE_CORRUPT, SQLITE_NOTADB: the file itself is damaged


def connect(path: str, busy_timeout_ms: int, max_page_count: int | None) -> sqlite3.Connection:
    """WAL, synchronous=FULL, autocommit (the writer opens its own transactions)."""
    conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=FULL")
        if max_page_count is not None:
            conn.execute(f"PRAGMA max_page_count={int(max_page_count)}")
    except BaseException:
        conn.close()
        raise
    return conn


def healthy(path: str) -> bool:
    """True when the file passes ``PRAGMA quick_check``; False only when SQLite says it is
    damaged (SQLITE_CORRUPT, SQLITE_NOTADB, or a quick_check answer other than ``ok``).
    Any other error -- a full disk that cannot take the ``-shm``, an I/O error, a lock, a
    permission -- says nothing about the file: it is raised, and the file stays where it
    is (moving a healthy file aside would empty the queue)."""
    try:
        conn = sqlite3.connect(path)
        try:
            row = conn.execute("PRAGMA quick_check").fetchone()
        finally:
            conn.close()
    except sqlite3.DatabaseError as exc:
        if not damaged(exc):
            raise
        log.error("DLQ quick_check of %s failed: %s", path, exc)
        return False
    if row is not None and row[0] == "ok":
        return True
    log.error("DLQ quick_check of %s found damage: %s", path, row)
    return False


def move_aside(path: str) -> str:
    """A damaged file and its WAL and shared memory go to ``<path>.corrupt-<time>``; nothing
    is deleted. Gives where they went."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    moved = f"{path}.corrupt-{stamp}"
    for suffix in schema.SUFFIXES:
        if os.path.exists(path + suffix):
            os.replace(path + suffix, moved + suffix)
    log.error(
        "DLQ file %s failed its integrity check; moved aside to %s and a new one "
        "started (nothing was deleted)",
        path,
        moved,
    )
    return moved


def damaged(exc: sqlite3.Error) -> bool:
    """The error says the file is not a sound database (extended codes keep the primary code
    in their low byte); anything else is about the disk, a lock or the process."""
    code = getattr(exc, "sqlite_errorcode", None)
    return code is not None and code & 0xFF in CORRUPT_CODES


def locked(exc: sqlite3.OperationalError) -> bool:
    """SQLITE_BUSY / SQLITE_LOCKED: another connection holds the file for now."""
    text = str(exc).lower()
    return "locked" in text or "busy" in text


def identity(path: str) -> tuple[int, int] | None:
    """(st_dev, st_ino) of the file at ``path``; None when there is none."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def copy_to_path(old: sqlite3.Connection, path: str) -> None:
    """Copy the open database into a new file and link it in at ``path`` (never over a file
    someone put there meanwhile), the directory synced."""
    tmp = f"{path}.restoring"
    for suffix in ("", "-journal", *schema.SUFFIXES[1:]):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp + suffix)
    try:
        schema.prepare_private_file(tmp)
        copy = sqlite3.connect(tmp)
        try:
            old.backup(copy)
        finally:
            copy.close()
        os.link(tmp, path)
    finally:
        for suffix in ("", "-journal", *schema.SUFFIXES[1:]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp + suffix)
    _sync_directory(path)


def _sync_directory(path: str) -> None:
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

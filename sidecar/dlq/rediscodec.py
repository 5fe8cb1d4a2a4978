"""A DLQ record as the fields of its Redis hash, and back as the dict a record is handed out as
(the same keys as the SQLite store's rows: ``rows.summary`` / ``rows.full``). Pure.

Every value is a string (the body bytes); a missing value (no status, no error, no claim) is the
empty string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from sidecar.dlq.record import NewRecord

Fields = Mapping[bytes, bytes]  # HGETALL, nothing decoded by the client


def encode(rid: str, rec: NewRecord) -> list[bytes | str]:
    """The field/value pairs a new record is stored with (status, seq and entry are the
    script's)."""
    return [
        "id", rid,
        "route", rec.route,
        "method", rec.method,
        "target", rec.target,
        "headers", json.dumps(rec.headers),
        "body", rec.body,
        "fate", rec.fate,
        "attempts", str(rec.attempts),
        "last_status", "" if rec.last_status is None else str(rec.last_status),
        "last_error", rec.last_error or "",
        "idempotency_key", rec.idempotency_key or "",
        "replays", "0",
        "size", str(rec.size),
        "created_at", repr(rec.created_at),
        "reached_upstream", "1" if rec.reached_upstream else "0",
        "claimed_by", "",
        "claimed_at", "",
        "claim_expires_at", "",
        "parked_reason", "",
    ]  # fmt: skip


def pairs(flat: list[Any]) -> dict[bytes, bytes]:
    """A flat [field, value, ...] reply (a script's HGETALL) as a mapping."""
    return {bytes(flat[i]): bytes(flat[i + 1]) for i in range(0, len(flat) - 1, 2)}


def _text(f: Fields, name: str) -> str:
    return f.get(name.encode(), b"").decode("utf-8", "surrogateescape")


def _opt_text(f: Fields, name: str) -> str | None:
    return _text(f, name) or None


def _opt_float(f: Fields, name: str) -> float | None:
    v = _text(f, name)
    return float(v) if v else None


def _opt_int(f: Fields, name: str) -> int | None:
    v = _text(f, name)
    return int(v) if v else None


def summary(f: Fields) -> dict[str, Any]:
    reached = _text(f, "reached_upstream")
    return {
        "seq": int(_text(f, "seq") or 0),
        "id": _text(f, "id"),
        "route": _text(f, "route"),
        "status": _text(f, "status"),
        "method": _text(f, "method"),
        "target": _text(f, "target"),
        "fate": _text(f, "fate"),
        "attempts": int(_text(f, "attempts") or 0),
        "last_status": _opt_int(f, "last_status"),
        "last_error": _opt_text(f, "last_error"),
        "idempotency_key": _opt_text(f, "idempotency_key"),
        "replays": int(_text(f, "replays") or 0),
        "size": int(_text(f, "size") or 0),
        "created_at": float(_text(f, "created_at") or 0.0),
        "updated_at": float(_text(f, "updated_at") or 0.0),
        "reached_upstream": None if not reached else reached == "1",
        "claimed_by": _opt_text(f, "claimed_by"),
        "claimed_at": _opt_float(f, "claimed_at"),
        "claim_expires_at": _opt_float(f, "claim_expires_at"),
        "parked_reason": _opt_text(f, "parked_reason"),
    }


def full(f: Fields) -> dict[str, Any]:
    out = summary(f)
    out["headers"] = [list(h) for h in json.loads(_text(f, "headers") or "[]")]
    out["body_bytes"] = bytes(f.get(b"body", b""))
    return out

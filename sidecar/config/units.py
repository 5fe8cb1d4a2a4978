"""Parsing of human-friendly durations (``250ms``, ``2s``) and sizes (``64KiB``)."""

from __future__ import annotations

import math
import re

# Upper bounds, so that arithmetic on a value (a deadline, a window times a rate, seconds to
# milliseconds) stays finite: an ``inf`` timeout broke every request. Durations stop at
# Envoy's (protobuf Duration's) 10,000 years; sizes at what a signed 64-bit integer holds
# (SQLite's integers). The digits are counted before int(), whose cost grows with them.
MAX_DURATION = 315_576_000_000.0
MAX_SIZE = 2**63 - 1
_MAX_DIGITS = 20

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
}
# A unit a reader takes for either power: ``1MB`` is 1,000,000 bytes to a disk vendor (and
# Kubernetes' ``M``), 1,048,576 to nginx (``1m``) and most people. Refused with both spellings
# that say which, rather than silently picking one.
_AMBIGUOUS = re.compile(r"^\s*(\d+)\s*([kmgKMG])[bB]?\s*$")
_POWERS = {"k": 1, "m": 2, "g": 3}
_BINARY = {"k": "KiB", "m": "MiB", "g": "GiB"}


class UnitError(ValueError):
    """A duration or size that cannot be parsed."""


def parse_duration(value: object) -> float:
    """Return seconds. Accepts ``250ms``, ``2s``, ``5m``, ``1h``; a bare number is an error
    because its unit would be a guess."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise UnitError(f"expected a duration like '250ms', '2s', '5m' or '1h', got {value!r}")
    m = _DURATION.match(value)
    if m is None:
        raise UnitError(f"expected a duration like '250ms', '2s', '5m' or '1h', got {value!r}")
    seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if not math.isfinite(seconds) or seconds > MAX_DURATION:
        raise UnitError(f"a duration must be at most {MAX_DURATION:.0f}s (10,000 years)")
    return seconds


def parse_size_or_unlimited(value: object) -> int:
    """``parse_size``, or ``unlimited``: the largest size there is (``MAX_SIZE``)."""
    if value == "unlimited":
        return MAX_SIZE
    try:
        return parse_size(value)
    except UnitError as e:
        raise UnitError(f"{e} (or 'unlimited')") from None


def parse_size(value: object) -> int:
    """Return bytes. Accepts an integer or ``512``, ``64KiB``, ``1MiB``, ``1GiB``."""
    if isinstance(value, bool):
        raise UnitError(f"expected a size like '512', '64KiB' or '1MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise UnitError(f"a size cannot be negative, got {value}")
        if value > MAX_SIZE:
            raise UnitError(f"a size must be at most {MAX_SIZE} bytes")
        return value
    if not isinstance(value, str):
        raise UnitError(f"expected a size like '512', '64KiB' or '1MiB', got {value!r}")
    m = _SIZE.match(value)
    if m is None:
        raise UnitError(
            _ambiguous(value) or f"expected a size like '512', '64KiB' or '1MiB', got {value!r}"
        )
    digits = m.group(1).lstrip("0") or "0"
    size = int(digits) * _SIZE_UNITS[m.group(2)] if len(digits) <= _MAX_DIGITS else MAX_SIZE + 1
    if size > MAX_SIZE:
        raise UnitError(f"a size must be at most {MAX_SIZE} bytes")
    return size


def _ambiguous(value: str) -> str | None:
    """The fix for a size written with a unit that means 1000 to some and 1024 to others
    (``1MB``, ``64k``, ``1mib``), or None."""
    m = _AMBIGUOUS.match(value)
    if m is None or len(m.group(1)) > _MAX_DIGITS:
        return None
    n, unit = int(m.group(1)), m.group(2).lower()
    decimal = n * 1000 ** _POWERS[unit]
    return (
        f"{value.strip()!r} is ambiguous ({decimal} or {n * 1024 ** _POWERS[unit]} bytes?): "
        f"write {n}{_BINARY[unit]} or {decimal}; sizes take B, KiB, MiB, GiB or none (bytes)"
    )

"""Parsing of human-friendly durations (``250ms``, ``2s``) and sizes (``64KiB``)."""

from __future__ import annotations

import re

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_SIZE_UNITS = {
    None: 1,
    "B": 1,
    "KiB": 1024,
    "MiB": 1024**2,
    "GiB": 1024**3,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}


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
    return float(m.group(1)) * _DURATION_UNITS[m.group(2)]


def parse_size(value: object) -> int:
    """Return bytes. Accepts an integer or ``512``, ``64KiB``, ``1MiB``, ``1GiB``."""
    if isinstance(value, bool):
        raise UnitError(f"expected a size like '512', '64KiB' or '1MiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise UnitError(f"a size cannot be negative, got {value}")
        return value
    if not isinstance(value, str):
        raise UnitError(f"expected a size like '512', '64KiB' or '1MiB', got {value!r}")
    m = _SIZE.match(value)
    if m is None:
        raise UnitError(f"expected a size like '512', '64KiB' or '1MiB', got {value!r}")
    return int(m.group(1)) * _SIZE_UNITS[m.group(2)]


def format_duration(seconds: float) -> str:
    """The inverse of parse_duration, for humans (explain, error messages)."""
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:g}s"
    return f"{seconds / 60:g}m"

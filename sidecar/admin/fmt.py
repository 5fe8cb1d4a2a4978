"""Figures for humans, shared by the status page and the ``status`` verb."""

from __future__ import annotations

import json
import re
from html import escape
from typing import Any

from sidecar.admin.killswitch import iso

# What a terminal would obey rather than show: C0 controls (ESC starts a sequence that clears
# the screen or retitles the window, BEL, CR overwrites the line, LF forges a row), DEL, C1
# controls (U+009B is a one-character CSI), the line and paragraph separators, and the
# bidirectional overrides and isolates that reorder what is shown (CVE-2021-42574).
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def age(seconds: float | None) -> str:
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"


def rate(v: float) -> str:
    if v == 0:
        return "0"
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 100 else f"{v:.0f}"


def pct(v: float | None) -> str:
    if v is None:
        return "—"
    return "100%" if v >= 1 else f"{v * 100:.2f}%" if v >= 0.99 else f"{v * 100:.1f}%"


def size(n: int) -> str:
    f = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if f < 1024 or unit == "GiB":
            return f"{f:.0f} {unit}" if unit == "B" else f"{f:.1f} {unit}"
        f /= 1024
    return f"{n} B"


def when(epoch: float | None) -> str:
    return "—" if epoch is None else iso(epoch).replace("T", " ")[:19] + "Z"


def success_class(v: float | None) -> str:
    if v is None:
        return "mute"
    return "ok" if v >= 0.99 else "warn" if v >= 0.9 else "bad"


def printable(value: Any) -> str:
    """``value`` as text a terminal shows as it is: every character from UNPRINTABLE written
    as its escape (``\\x1b``, ``\\u202e``), as kubectl does since CVE-2021-25743. For anything
    the CLI prints that came from the server or a config file."""
    return UNPRINTABLE.sub(_escape, str(value))


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def printable_json(value: Any) -> str:
    """JSON for a terminal: ``json.dumps`` escapes C0 controls and, with ``ensure_ascii``,
    everything above ASCII; DEL is the one it leaves raw (JSON allows ``\\u007f``)."""
    return json.dumps(value, indent=2).replace("\x7f", "\\u007f")


def figure_text(value: object) -> str | None:
    """A route figure as a table cell shows it; None for none (each table has its dash)."""
    if value is None:
        return None
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def tls_items(listener: dict[str, Any] | None) -> list[tuple[str, str]]:
    """The TLS listener's certificate and client CA for the page's process list (subject,
    expiry, the time left, warned within 14 days); nothing for a plaintext listener."""
    out: list[tuple[str, str]] = []
    for label, slug in (("TLS listener certificate", "cert"), ("TLS client CA", "client_ca")):
        c = (listener or {}).get(slug)
        if c is None:
            continue
        left = float(c["expires_in"])
        klass = "bad" if left < 14 * 86400 else "ok"
        out.append(
            (
                label,
                f'<code id="tls-{slug}">{escape(c["subject"])}</code> <small>expires '
                f'<span class="{klass}">{escape(c["not_after"])}</span> (in {age(left)})</small>',
            )
        )
    return out

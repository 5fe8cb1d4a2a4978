"""Figures for humans, shared by the status page and the ``status`` verb."""

from __future__ import annotations

from sidecar.admin.killswitch import iso


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

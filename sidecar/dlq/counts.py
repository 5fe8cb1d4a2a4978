"""What the DLQ's gauges show: its records counted by status, and the oldest pending one."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Counts:
    """What the gauges show; replaced whole by the store that publishes it, read by the loop."""

    by_status: dict[str, int] = field(default_factory=dict)
    oldest_pending: float | None = None  # created_at (epoch) of the oldest pending record

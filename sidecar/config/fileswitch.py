"""What one entry of the ``killswitches:`` section is, once parsed (``killswitches``). Its own
module: the config model holds these without importing the YAML parser."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FileKillSwitch:
    """One entry of the ``killswitches:`` section: retries off for ``scope`` until ``until``."""

    scope: str  # "global" or "route:<name>"
    reason: str
    until: float  # epoch seconds
    line: int  # where the entry is written, for warnings and set_by
    index: int  # its position in the list: killswitches[index]

"""The current config snapshot. A reload swaps one reference; readers take it once."""

from __future__ import annotations

import time
from dataclasses import dataclass

from sidecar.config.model import Config


@dataclass(frozen=True, slots=True)
class LoadRecord:
    loaded_at: float  # epoch seconds


class ConfigStore:
    def __init__(self, config: Config) -> None:
        self._current = config
        self.loaded = LoadRecord(time.time())
        self.last_error: str | None = None

    @property
    def current(self) -> Config:
        return self._current

    def swap(self, config: Config) -> None:
        self._current = config
        self.loaded = LoadRecord(time.time())
        self.last_error = None

    def restore(self, config: Config, loaded: LoadRecord) -> None:
        """Put back a config that was current (an apply that failed half-way)."""
        self._current = config
        self.loaded = loaded

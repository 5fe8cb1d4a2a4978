"""Configuration errors that name the file, line and key path."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class ConfigIssue:
    line: int
    path: str
    message: str

    def render(self, source: str) -> str:
        return f"{source}:{self.line}: {self.path}: {self.message}"


class ConfigError(ValueError):
    """One or more problems found while loading a config; nothing of it may be used."""

    def __init__(self, source: str, issues: list[ConfigIssue]) -> None:
        self.source = source
        self.issues = issues
        super().__init__("\n".join(i.render(source) for i in issues))

    def lines(self) -> list[str]:
        return [i.render(self.source) for i in self.issues]

"""Exception tree of the data package."""

from __future__ import annotations


class DataError(Exception):
    """Base class of every error raised by ``data``."""


class MalformedLineError(DataError):
    """A Criteo line that does not parse; the message names file and line number."""

    def __init__(self, path: str, lineno: int, reason: str) -> None:
        self.path = path
        self.lineno = lineno
        self.reason = reason
        super().__init__(f"{path}:{lineno}: {reason}")

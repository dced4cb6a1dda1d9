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


class CorruptFileError(DataError):
    """A compressed file that ends early or does not decompress; names the file and where it broke."""

    @classmethod
    def at(cls, path, after_line: int, e: Exception) -> CorruptFileError:
        return cls(
            f"{path}: compressed data ends or breaks after line {after_line} ({e or type(e).__name__}); "
            "the file is truncated or damaged: download or copy it again"
        )

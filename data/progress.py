"""Progress for long work: a bar on a terminal, plain lines elsewhere.

A progress bar redraws one line with carriage returns: right on a terminal, wrong in a file, a pipe
or CI's log, where a long run became one line of tens of thousands of characters. ``progress(...)``
gives tqdm's bar when its stream is a terminal and a ``Lines`` otherwise: one plain line every
``every_s`` seconds or every tenth of the work, whichever comes first, and one at the end. Both
take the calls the project makes: ``update``, ``n``, ``set_postfix``, ``refresh``, ``close``,
iteration and ``with``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any, TextIO

EVERY_S = 10.0
"""Seconds between two plain progress lines at most (and one at every tenth of the work)."""


def _tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or odd stream: no terminal
        return False


def progress(
    iterable: Iterable | None = None,
    *,
    total: int | None = None,
    desc: str = "",
    unit: str = "it",
    initial: int = 0,
    disable: bool = False,
    file: TextIO | None = None,
    every_s: float = EVERY_S,
) -> Any:
    """tqdm's bar on a terminal; ``Lines`` when ``file`` (default stderr) is a file or a pipe."""
    stream = file if file is not None else sys.stderr
    if _tty(stream) or disable:
        from tqdm import tqdm

        return tqdm(
            iterable,
            total=total,
            desc=desc,
            unit=unit,
            initial=initial,
            disable=disable,
            file=stream,
            dynamic_ncols=True,
        )
    return Lines(iterable, total=total, desc=desc, unit=unit, initial=initial, file=stream, every_s=every_s)


class Lines:
    """Progress as plain lines: ``{desc}: {unit} {n}/{total} ({pct}%), {postfix}``."""

    def __init__(
        self,
        iterable: Iterable | None = None,
        *,
        total: int | None = None,
        desc: str = "",
        unit: str = "it",
        initial: int = 0,
        file: TextIO | None = None,
        every_s: float = EVERY_S,
    ) -> None:
        self.iterable = iterable
        self.total = total if total is not None else (len(iterable) if hasattr(iterable, "__len__") else None)  # type: ignore[arg-type]
        self.desc, self.unit, self.file, self.every_s = desc, unit, file or sys.stderr, every_s
        self.n = initial
        self._postfix = ""
        self._shown_n = initial
        self._shown_t = time.monotonic()
        self._closed = False

    # -- what the callers use -------------------------------------------------------------------
    def update(self, k: int = 1) -> None:
        self.n += k
        self.refresh()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self._postfix = ", ".join(f"{k.replace('_per_', '/')} {v}" for k, v in values.items())
        if refresh:
            self.refresh()

    def refresh(self) -> None:
        """Print a line if one is due: ``every_s`` passed, or a tenth of the work was done."""
        if self.n == self._shown_n:
            return
        now = time.monotonic()
        tenth = max(1, (self.total or 0) // 10)
        if now - self._shown_t >= self.every_s or (self.total and self.n // tenth != self._shown_n // tenth):
            self._show(now)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self.n != self._shown_n:
                self._show(time.monotonic())

    def write(self, line: str) -> None:
        print(line, file=self.file, flush=True)

    def __iter__(self) -> Iterator:
        assert self.iterable is not None, "Lines: nothing to iterate"
        try:
            for x in self.iterable:
                yield x
                self.update()
        finally:
            self.close()

    def __enter__(self) -> Lines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the line ------------------------------------------------------------------------------
    def line(self) -> str:
        head = f"{self.desc}: " if self.desc else ""
        if self.total:
            done = f"{self.unit} {self.n}/{self.total} ({100 * self.n // self.total}%)"
        else:
            done = f"{self.n} {self.unit}"
        return head + done + (f", {self._postfix}" if self._postfix else "")

    def _show(self, now: float) -> None:
        self._shown_n, self._shown_t = self.n, now
        self.write(self.line())

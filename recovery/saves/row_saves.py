"""Row saves between checkpoints, off the training path: priority saves (``partial-mfu``,
``partial-ssu``), flushes (``incremental``), and what a checkpoint closes (the update totals of its
step, the log segment that starts after it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from recovery.accounting import UpdateCounter

if TYPE_CHECKING:
    from recovery.saves.incremental import Flusher
    from recovery.saves.priority import PrioritySaver


@dataclass
class RowSaves:
    counter: UpdateCounter
    priority: PrioritySaver | None
    flusher: Flusher | None
    logs: dict  # shard -> its update log (``recovery.log.ShardLog``)

    def on_checkpoint(self, step: int) -> None:
        self.counter.mark(step)
        for w in (self.priority, self.flusher):
            if w is not None:
                w.on_checkpoint(step)
        for log in self.logs.values():
            log.open_segment(step + 1)

    def flush(self, step: int) -> int:
        """incremental: this writer's rows dirtied since its last flush go to disk (off the path);
        the update totals as of ``step`` are kept for the loss accounting of a restore to it."""
        self.counter.mark(step)
        return self.flusher.flush(step) if self.flusher is not None else 0

    def save_priority(self, step: int) -> int:
        """partial-mfu / partial-ssu: this writer's priority rows copied (a thread writes them)."""
        return self.priority.save(step) if self.priority is not None else 0

    def prepare_priority(self) -> None:
        """The next priority save's rows picked now, off the path."""
        if self.priority is not None:
            self.priority.prepare()

    def suspend_flushes(self) -> None:
        """After a restart: rows dirtied before it are unknown (the next flush is whole)."""
        if self.flusher is not None:
            self.flusher.suspend()

"""A write-behind window: the rows of several steps reach their shards in one write.

With ``write_every`` K (one trainer, write-behind, every table held), a step's updated rows are
held at once (pinned in the bounded row cache until written) (the next step reads them there) and go to their shards when the window closes:
every K steps, or early where something reads the shards (a save, an evaluation, the end) or a
shard failed. The window's write carries each row once, as of the window's last step, and an undo
record of the rows' values before the window (each row's value when the window first updated it):
the shard can be taken back to its last write as after a one-step write. A row updated in most
steps (the hot rows of a Zipf batch stream) is written once per window instead of once per step,
which is what the servers spend their time on.
"""

from __future__ import annotations

import numpy as np

from embeddings.store.row_cache import HeldRows


def closes_window(step: int, every: int) -> bool:
    """Whether a window of ``every`` steps closes at ``step``: its multiples, and step 1."""
    return step % every == 0 or step == 1


class Window:
    def __init__(self, held: HeldRows, every: int) -> None:
        if every < 2:
            raise ValueError(f"write_every {every}: a window spans at least 2 steps")
        self.every = every
        self.held = held
        self._keys: list[np.ndarray] = []  # per step: the keys it updated first in the window
        self._undo: list[np.ndarray] = []  # their rows before the window
        self.updates: list[tuple[object, int]] = []  # (update, step) of each step in the window

    @property
    def open(self) -> bool:
        return bool(self.updates)

    def closes_at(self, step: int) -> bool:
        """Every ``every`` steps, and at step 1: a run has a restart point (its dense state) from its
        first step on, as with a write every step."""
        return closes_window(step, self.every)

    def add(self, update, step: int, keys: np.ndarray, before: np.ndarray) -> None:
        """Step ``step`` updates ``keys`` (sorted packed keys), whose rows were ``before``; called
        before their new rows are pinned in the held rows (``RowWrites.hold_written(pin=True)``),
        where they stay until ``take``."""
        # a key already in the window is pinned: one look-up of the step's own keys, no search of
        # the window's
        fresh = ~self.held.pinned(keys)
        if fresh.all():  # kept over steps: a copy, whatever the caller does with its array later
            before = before.copy()
        else:
            at = np.flatnonzero(fresh)  # a gather by positions: a fifth of a boolean mask's time for rows
            keys, before = keys[at], np.take(before, at, axis=0)
        self._keys.append(keys)
        self._undo.append(before)
        self.updates.append((update, step))

    def take(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[tuple[object, int]]]:
        """Close the window: -> (sorted keys it updated, their rows now, their rows before it, its
        steps' updates). The rows are a copy: the next steps update the held rows in place; they are
        unpinned (the write that takes them is the window's commit point)."""
        keys = np.concatenate(self._keys)
        undo = np.concatenate(self._undo)
        order = np.argsort(keys, kind="stable")
        keys, undo = keys[order], undo[order]
        first = np.ones(len(keys), bool)  # each key once, with its value before the window (its first step's)
        first[1:] = keys[1:] != keys[:-1]
        if not first.all():  # only where the held rows were let go with the window open
            keys, undo = keys[first], undo[first]
        rows = self.held.copy_rows(keys)
        if rows is None:
            raise RuntimeError("a write-behind window's rows are no longer held")
        self.held.unpin(keys)
        updates = self.updates
        self._reset()
        return keys, rows, undo, updates

    def clear(self) -> None:
        """Forget the open window (a rollback took the rows back before it)."""
        if self._keys:
            self.held.unpin(np.concatenate(self._keys))
        self._reset()

    def _reset(self) -> None:
        self._keys, self._undo, self.updates = [], [], []

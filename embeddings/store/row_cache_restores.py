"""What a restore of a shard leaves of the rows a trainer holds (``HeldRows.restores``).

A restore, rollback or reconnect of a shard forgets that shard's rows (``clear(shard)``), whose
next reads go to Redis again; the other shards' rows stay. The slots forgotten are remembered per
shard, so that a restore that brought the shard back to exactly what its writer wrote (a log
replay) holds them again (``reinstate``), and a restore to an earlier step holds again the rows
last written before that step and knows the rows first written after it as never written
(``restored``): only the rest are read back (``unknown``).
"""

from __future__ import annotations

import numpy as np

from embeddings import rowkeys
from embeddings.store.row_slots import HELD, UNKNOWN, RowSlots


class HeldRestores:
    """Given the cache's slots (``clear_by_owner``: a shard's rows can be told apart, else ``clear``
    forgets every row; ``rows_by_owner``: ``shard_rows`` can pick a shard's)."""

    def __init__(self, slots: RowSlots, clear_by_owner: bool, rows_by_owner: bool) -> None:
        self.held = slots
        self._clear_by_owner, self._rows_by_owner = clear_by_owner, rows_by_owner
        self._forgotten: dict[int, list[np.ndarray]] = {}  # per shard: slots held until ``clear`` forgot them

    def clear(self, shard: int | None = None) -> None:
        """Forget the rows of ``shard`` (None: of every shard); a read begun before learns nothing.
        A row known never written stays so: a restore, a rollback or a promotion brings a shard back
        to an earlier state of its own writes, where that row was not written either (a rollback
        that writes a row's lazy-init value back leaves what the lazy init gives)."""
        h = self.held
        with h.lock:
            h.generation += 1
            h.version += 1
            held = h.state == HELD
            if shard is not None and self._clear_by_owner:
                held &= h.owner == shard
            h.state[held] = UNKNOWN
            if shard is None or not self._clear_by_owner:
                self._forgotten.clear()
            else:  # merged when used (``_take_forgotten``): a restore clears a shard more than once
                parts = self._forgotten.setdefault(shard, [])
                parts.append(np.flatnonzero(held))
                if len(parts) > 4:  # cleared again and again with no restore between: bounded
                    parts[:] = [self._merged(parts)]

    def reinstate(self, shard: int) -> int:
        """The shard was restored to exactly what this writer had written to it (a log replay up to
        its last step): the rows ``clear`` forgot are held again, with the values they had (a row
        written or read since keeps its state). -> rows held again."""
        h = self.held
        with h.lock:
            pos = self._take_forgotten(shard)
            if not len(pos):
                return 0
            h.version += 1
            h.state[pos] = HELD
            return len(pos)

    def restored(
        self, shard: int, kept_upto: int, absent_after: int, overlay: tuple[np.ndarray, int] | None = None
    ) -> tuple[int, int]:
        """The shard was restored to its state as of step ``kept_upto`` (a checkpoint), plus rows of
        later steps up to ``absent_after`` at most (a priority save, flushes, a log's records). Of the
        rows ``clear`` forgot: one this writer last wrote at ``kept_upto`` or before has the value it
        holds, so it is held again; one it first wrote after ``absent_after`` did not exist then, so
        it is known never written; the rest stay unknown (read back). ``overlay``: (packed keys,
        step) of the only rows written on top, with the values this writer held at that step (its
        own priority save): those last written by then are held again too, and any other row first
        written after ``kept_upto`` is known never written. -> (held again, now absent)."""
        h = self.held
        with h.lock:
            pos = self._take_forgotten(shard)
            if not len(pos):
                return 0, 0
            h.version += 1
            first, last = h.first[pos], h.last[pos]
            if overlay is None:
                kept = pos[last <= kept_upto]
                gone = pos[first > absent_after]
            else:
                keys, step = overlay
                on_top = np.isin(h.key[pos], np.asarray(keys, np.int64))
                kept = pos[(last <= kept_upto) | (on_top & (last <= step))]
                gone = pos[(first > kept_upto) & ~on_top]
            h.state[kept] = HELD
            h.set_absent(gone)
            return len(kept), len(gone)

    def _take_forgotten(self, shard: int) -> np.ndarray:
        """The slots ``clear`` forgot on ``shard`` that still hold its unknown rows (each once); forgets
        the list."""
        h = self.held
        pos = self._merged(self._forgotten.pop(shard, []))
        return pos[(h.state[pos] == UNKNOWN) & (h.owner[pos] == shard)]

    def _merged(self, parts: list[np.ndarray]) -> np.ndarray:
        """Sorted slots in any of ``parts`` (a row forgotten, held again and forgotten again is in two),
        by a mark per slot: linear, where a sort of the slots is not."""
        if len(parts) <= 1:
            return parts[0] if parts else np.empty(0, np.int64)
        mark = np.zeros(len(self.held.state), bool)
        for p in parts:
            mark[p] = True
        return np.flatnonzero(mark)

    def shard_rows(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the rows held of ``shard`` (every shard's without an owner map): (packed keys,
        rows [n, width]) in slot order: what a shard restored in the background is read from
        meanwhile (``embeddings.store.outage``)."""
        h = self.held
        with h.lock:
            sel = h.state == HELD
            if self._rows_by_owner:
                sel &= h.owner == shard
            pos = np.flatnonzero(sel)
            return h.key[pos], np.take(h.rows, pos, axis=0)

    def drop_forgotten(self, shard: int) -> None:
        """The forgotten rows of ``shard`` are not to be held again (their shard went back to an
        earlier state)."""
        with self.held.lock:
            self._forgotten.pop(shard, None)

    def unknown(self, shard: int) -> dict[int, np.ndarray]:
        """Table -> ids of ``shard``'s cached rows whose value is not known here (forgotten since held)."""
        h = self.held
        with h.lock:
            mask = h.state == UNKNOWN
            if self._clear_by_owner:
                mask &= h.owner == shard
            keys = np.sort(h.key[mask])
        return {t: ids for t, (ids, _, _) in rowkeys.table_groups(keys).items()}

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
from embeddings.store import held as _held


class HeldRestores:
    def __init__(self, held) -> None:
        self.held = held
        self._forgotten: dict[int, list[np.ndarray]] = {}  # per shard: slots held until ``clear`` forgot them

    def clear(self, shard: int | None = None) -> None:
        """Forget the rows of ``shard`` (None: of every shard); a read begun before learns nothing.
        A row known never written stays so: a restore, a rollback or a promotion brings a shard back
        to an earlier state of its own writes, where that row was not written either (a rollback
        that writes a row's lazy-init value back leaves what the lazy init gives)."""
        h = self.held
        with h._lock:
            h.generation += 1
            h.version += 1
            held = h._state == _held.HELD
            if shard is not None and h._owner_of is not None:
                held &= h._owner == shard
            h._state[held] = _held.UNKNOWN
            if shard is None or h._owner_of is None:
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
        with h._lock:
            pos = self._take_forgotten(shard)
            if not len(pos):
                return 0
            h.version += 1
            h._state[pos] = _held.HELD
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
        with h._lock:
            pos = self._take_forgotten(shard)
            if not len(pos):
                return 0, 0
            h.version += 1
            first, last = h._first[pos], h._last[pos]
            if overlay is None:
                kept = pos[last <= kept_upto]
                gone = pos[first > absent_after]
            else:
                keys, step = overlay
                on_top = np.isin(h._key[pos], np.asarray(keys, np.int64))
                kept = pos[(last <= kept_upto) | (on_top & (last <= step))]
                gone = pos[(first > kept_upto) & ~on_top]
            h._state[kept] = _held.HELD
            h._set_absent(gone)
            return len(kept), len(gone)

    def _take_forgotten(self, shard: int) -> np.ndarray:
        """The slots ``clear`` forgot on ``shard`` that still hold its unknown rows (each once); forgets
        the list."""
        h = self.held
        pos = self._merged(self._forgotten.pop(shard, []))
        return pos[(h._state[pos] == _held.UNKNOWN) & (h._owner[pos] == shard)]

    def _merged(self, parts: list[np.ndarray]) -> np.ndarray:
        """Sorted slots in any of ``parts`` (a row forgotten, held again and forgotten again is in two),
        by a mark per slot: linear, where a sort of the slots is not."""
        if len(parts) <= 1:
            return parts[0] if parts else np.empty(0, np.int64)
        mark = np.zeros(len(self.held._state), bool)
        for p in parts:
            mark[p] = True
        return np.flatnonzero(mark)

    def shard_rows(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the rows held of ``shard`` (every shard's without an owner map): (packed keys,
        rows [n, width]) in slot order: what a shard restored in the background is read from
        meanwhile (``embeddings.store.outage``)."""
        h = self.held
        with h._lock:
            sel = h._state == _held.HELD
            if h._owner_of is not None or h._owner_of_keys is not None:
                sel &= h._owner == shard
            pos = np.flatnonzero(sel)
            return h._key[pos], np.take(h._rows, pos, axis=0)

    def drop_forgotten(self, shard: int) -> None:
        """The forgotten rows of ``shard`` are not to be held again (their shard went back to an
        earlier state)."""
        with self.held._lock:
            self._forgotten.pop(shard, None)

    def unknown(self, shard: int) -> dict[int, np.ndarray]:
        """Table -> ids of ``shard``'s cached rows whose value is not known here (forgotten since held)."""
        h = self.held
        with h._lock:
            mask = h._state == _held.UNKNOWN
            if h._owner_of is not None:
                mask &= h._owner == shard
            keys = np.sort(h._key[mask])
        return {t: ids for t, (ids, _, _) in rowkeys.table_groups(keys).items()}

"""Rows a trainer writes, held in its own memory (write-through).

Each shard has a single writer, so the rows it wrote are exactly what the shard holds until the
next write, unless recovery changes the shard behind its back. ``HeldRows`` keeps one dense
``[rows of all held tables, dim + state]`` float32 array (table t from its base offset) and each
row's state (unknown, held, known never written), for the rows of the shards this trainer writes,
so that one gather serves a whole batch of packed row keys: an update reads current rows (weights and optimizer state) from here instead of
re-reading them from Redis, and a stage of the next batch reads them from here too. Rows enter
after the write that put them on their shard succeeded, or from a read of their shard (``found``);
a restore, rollback or reconnect of a shard forgets that shard's rows (``clear(shard)``), whose next
reads go to Redis again; the other shards' rows stay. A restore that brought the shard back to
exactly what its writer wrote (a log replay) holds them again (``reinstate``); a restore to an
earlier step holds again the rows last written before that step, and knows the rows first written
after it as never written (``restored``), so only the rest are read back. With ``init`` (the lazy
init of packed keys), a row known never written holds its initial value from the moment it is known
so, as an engine that allocates its tables initialises them: a batch of held and never-written
rows is one gather (``read_keys``).

Tables that would not fit ``budget_bytes`` (with those before them), or whose row width differs
from the first table's, are not held.
"""

from __future__ import annotations

import threading

import numpy as np

from embeddings import rowkeys
from embeddings.tables import TableSet


def put_rows(dst: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
    """``dst[at] = rows`` for C-contiguous float32 [n, width] arrays, each row moved as one item
    (a third less time than numpy's element-wise fancy assignment for 17-float rows)."""
    if not rows.flags.c_contiguous or rows.dtype != dst.dtype:
        rows = np.ascontiguousarray(rows, dst.dtype)
    item = np.dtype((np.void, dst.dtype.itemsize * dst.shape[1]))
    dst.view(item).reshape(-1)[at] = rows.view(item).reshape(-1)


UNKNOWN, HELD, ABSENT = 0, 1, 2  # ABSENT: read as never written; only its writer could write it
NEVER = np.iinfo(np.int32).max  # a row's last write at an unknown step: never assumed older than a restore


class HeldRows:
    def __init__(
        self, tables: TableSet, widths: list[int], shards: set[int], budget_bytes: int, owner_of=None, init=None
    ) -> None:
        """``owner_of(table, ids)``: the shard of each row (``ShardMap.shard_of``), so that a shard's
        rows can be forgotten alone; without it ``clear`` forgets every row. ``init(keys)``: the
        initial rows [n, width] of packed keys (lazy-init weights, zero optimizer state)."""
        self.shards = set(shards)
        self._init = init
        # one flat [rows, width] array for every held table (one gather serves a whole batch); table t
        # starts at _base[t], or is not held (-1): over the budget, or a row width unlike the first's
        self.width = widths[0]
        self._base = np.full(len(tables.specs), -1, np.int64)
        total = 0
        for t, spec in enumerate(tables.specs):
            if widths[t] != self.width or (total + spec.num_rows) * self.width * 4 > budget_bytes:
                continue
            self._base[t] = total
            total += spec.num_rows
        self._num_rows = [spec.num_rows for spec in tables.specs]
        held = np.flatnonzero(self._base >= 0)
        self._held_tables, self._held_bases = held, self._base[held]  # flat position -> table
        # every page is touched now, as an engine that allocates its tables does: left to the first
        # write of each row, a step that writes thousands of new rows faults in a page for each
        self._rows = np.empty((total, self.width), np.float32)
        self._rows.fill(0.0)
        self._state = np.zeros(total, np.int8)  # UNKNOWN, HELD or ABSENT per row
        # per row, the step of this writer's first write since the row was known never written (-1:
        # it may have existed before) and of its last write (NEVER: unknown): what a restore to an
        # earlier step left of the row is known without reading it (``restored``)
        self._first = np.full(total, -1, np.int32)
        self._last = np.full(total, NEVER, np.int32)
        self._owner = None  # the shard of each row
        if owner_of is not None and total:
            self._owner = np.empty(total, np.int16)
            for t, spec in enumerate(tables.specs):
                if self._base[t] >= 0:
                    ids = np.arange(spec.num_rows, dtype=np.int64)
                    self._owner[self._base[t] : self._base[t] + spec.num_rows] = owner_of(t, ids)
        self.bytes = total * self.width * 4
        self.hits = 0
        self.generation = 0  # bumped by clear(): what a read learned before it is void
        self.version = 0  # bumped by every change: a read of rows held at this version is still current
        self._lock = threading.Lock()
        self._forgotten: dict[int, list[np.ndarray]] = {}  # per shard: rows held until ``clear`` forgot them

    @property
    def positions(self) -> int:
        """Rows of every held table (the length of the flat arrays)."""
        return len(self._rows)

    def holds_all(self) -> bool:
        """Every table is held."""
        return bool((self._base >= 0).all()) and len(self._rows) > 0

    def holds(self, table: int) -> bool:
        return bool(self._base[table] >= 0)

    def flat(self, keys: np.ndarray) -> np.ndarray | None:
        """Positions in the flat arrays of packed row keys (``embeddings.rowkeys``); -1 where the
        key's table is not held. None when no table is held."""
        if not len(self._rows):
            return None
        tables, ids = rowkeys.unpack(keys)
        base = self._base[tables]
        return np.where(base >= 0, base + ids, -1)

    def lookup_keys(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (positions of ``keys`` held here, their rows [n, width], positions known never written)."""
        at = self.flat(keys)
        if at is None:
            return np.empty(0, np.int64), np.empty((0, self.width), np.float32), np.empty(0, np.int64)
        known = np.where(at >= 0, self._state[np.maximum(at, 0)], UNKNOWN)
        pos = np.flatnonzero(known == HELD)
        self.hits += len(pos)
        return pos, np.take(self._rows, at if len(pos) == len(at) else at[pos], axis=0), np.flatnonzero(known == ABSENT)

    def read_keys(self, keys: np.ndarray) -> np.ndarray | None:
        """Rows [n, width] of packed keys by one gather, when every one is held or known never written
        (whose held value is then its initial one); None when any is not, or without ``init``."""
        if self._init is None or not len(keys):
            return None
        at = self.flat(keys)
        if at is None or at.min() < 0 or bool((self._state[at] == UNKNOWN).any()):
            return None
        self.hits += len(at)
        return np.take(self._rows, at, axis=0)

    def copy_rows(self, keys: np.ndarray) -> np.ndarray | None:
        """A copy of the rows of packed keys, when every one is held (not counted as a read: the
        rows go to their shards); else None."""
        at = self.flat(keys)
        if at is None or not len(at) or at.min() < 0 or not bool(np.all(self._state[at] == HELD)):
            return None
        return np.take(self._rows, at, axis=0)

    def _keys_at(self, at: np.ndarray) -> np.ndarray:
        """Packed row keys of flat positions."""
        i = np.searchsorted(self._held_bases, at, side="right") - 1
        return rowkeys.pack(0, at - self._held_bases[i]) | (self._held_tables[i] << rowkeys.ROW_BITS)

    def _set_absent(self, at: np.ndarray, chunk: int = 1 << 20) -> None:
        """Rows at flat positions ``at`` are known never written: with ``init``, they hold their
        initial values from now (under ``_lock``)."""
        self._state[at] = ABSENT
        if self._init is not None:
            for lo in range(0, len(at), chunk):
                part = at[lo : lo + chunk]
                put_rows(self._rows, part, self._init(self._keys_at(part)))

    def gather(self, at: np.ndarray) -> np.ndarray | None:
        """Rows at flat positions ``at`` (from ``flat``), when every one of them is held; else None."""
        if not len(at) or at.min() < 0 or not bool(np.all(self._state[at] == HELD)):
            return None
        self.hits += len(at)
        return np.take(self._rows, at, axis=0)  # a quarter of the time of rows[at]

    def lookup(self, table: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """-> (positions of ``ids`` held here, their rows, positions known never written), or None
        when the table is not held."""
        if not self.holds(table):
            return None
        return self.lookup_keys(rowkeys.pack(table, np.asarray(ids, np.int64)))

    def put_keys(self, keys: np.ndarray, rows: np.ndarray, step: int | None = None) -> None:
        """Rows just written to their shard (one of ``shards``), by the training step ``step`` (None:
        a write outside the steps, whose step no restore can be compared with)."""
        at = self.flat(keys)
        if at is None:
            return
        mine = at >= 0
        if not mine.all():
            at, rows = at[mine], rows[mine]
        with self._lock:
            self.version += 1
            put_rows(self._rows, at, rows)
            if step is None:
                self._first[at], self._last[at] = -1, NEVER
            else:
                state = self._state[at]
                fresh = state != HELD  # mostly none on a step's path: one mask, no index arrays
                if fresh.any():  # a first write: absent at any earlier step; unknown: may have existed
                    self._first[at[fresh]] = np.where(state[fresh] == ABSENT, step, -1)
                self._last[at] = step
            self._state[at] = HELD

    def put(self, table: int, ids: np.ndarray, rows: np.ndarray) -> None:
        if self.holds(table):
            self.put_keys(rowkeys.pack(table, np.asarray(ids, np.int64)), rows)

    def absent(self, table: int, ids: np.ndarray, generation: int) -> None:
        """Rows of ``shards`` that a read (begun at ``generation``) found never written. A row written
        or forgotten since that read began keeps its state."""
        self._learned(table, ids, None, generation)

    def found(self, table: int, ids: np.ndarray, rows: np.ndarray, generation: int) -> None:
        """Rows of ``shards`` that a read (begun at ``generation``) found on their shard: as the
        single writer, this trainer holds them from now on. A row written or forgotten since that
        read began keeps its state (a write since holds newer values)."""
        self._learned(table, ids, rows, generation)

    def _learned(self, table: int, ids: np.ndarray, rows: np.ndarray | None, generation: int) -> None:
        """What a read learned of rows still unknown: their values (``rows``), or that they are absent."""
        if not self.holds(table):
            return
        at = self._base[table] + np.asarray(ids, np.int64)
        with self._lock:
            if generation != self.generation:
                return
            self.version += 1
            new = self._state[at] == UNKNOWN
            if rows is not None:
                self._rows[at[new]] = rows[new]
                self._first[at[new]], self._last[at[new]] = -1, NEVER  # read: its writes' steps unknown
                self._state[at[new]] = HELD
            else:
                self._set_absent(at[new])

    def assume_absent(self, table: int, ids: np.ndarray) -> None:
        """Rows known never written (a fresh run's own rows): reads of them need not go to Redis."""
        if self.holds(table):
            with self._lock:
                self.version += 1
                self._set_absent(self._base[table] + np.asarray(ids, np.int64))

    def clear(self, shard: int | None = None) -> None:
        """Forget the rows of ``shard`` (None: of every shard); a read begun before learns nothing.
        A row known never written stays so: a restore, a rollback or a promotion brings a shard back
        to an earlier state of its own writes, where that row was not written either (a rollback
        that writes a row's lazy-init value back leaves what the lazy init gives)."""
        with self._lock:
            self.generation += 1
            self.version += 1
            held = self._state == HELD
            if shard is not None and self._owner is not None:
                held &= self._owner == shard
            self._state[held] = UNKNOWN
            if shard is None or self._owner is None:
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
        with self._lock:
            pos = self._take_forgotten(shard)
            if not len(pos):
                return 0
            self.version += 1
            self._state[pos] = HELD
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
        with self._lock:
            pos = self._take_forgotten(shard)
            if not len(pos):
                return 0, 0
            self.version += 1
            first, last = self._first[pos], self._last[pos]
            if overlay is None:
                kept = pos[last <= kept_upto]
                gone = pos[first > absent_after]
            else:
                keys, step = overlay
                at = self.flat(keys)
                on_top = np.zeros(len(self._state), bool)
                on_top[at[at >= 0]] = True
                on_top = on_top[pos]
                kept = pos[(last <= kept_upto) | (on_top & (last <= step))]
                gone = pos[(first > kept_upto) & ~on_top]
            self._state[kept] = HELD
            self._set_absent(gone)
            return len(kept), len(gone)

    def _take_forgotten(self, shard: int) -> np.ndarray:
        """The rows ``clear`` forgot on ``shard`` that are still unknown (each once); forgets the list."""
        pos = self._merged(self._forgotten.pop(shard, []))
        return pos[self._state[pos] == UNKNOWN]

    def _merged(self, parts: list[np.ndarray]) -> np.ndarray:
        """Sorted positions in any of ``parts`` (a row forgotten, held again and forgotten again is
        in two), by a mark per row: linear, where a sort of the positions is not."""
        if len(parts) <= 1:
            return parts[0] if parts else np.empty(0, np.int64)
        mark = np.zeros(len(self._state), bool)
        for p in parts:
            mark[p] = True
        return np.flatnonzero(mark)

    def drop_forgotten(self, shard: int) -> None:
        """The forgotten rows of ``shard`` are not to be held again (their shard went back to an
        earlier state)."""
        with self._lock:
            self._forgotten.pop(shard, None)

    def unknown(self, shard: int) -> dict[int, np.ndarray]:
        """Table -> ids of ``shard``'s rows whose value is not known here (forgotten since held)."""
        out = {}
        for t in np.flatnonzero(self._base >= 0).tolist():
            lo = int(self._base[t])
            hi = lo + self._num_rows[t]
            mask = self._state[lo:hi] == UNKNOWN
            if self._owner is not None:
                mask &= self._owner[lo:hi] == shard
            ids = np.flatnonzero(mask)
            if len(ids):
                out[t] = ids
        return out

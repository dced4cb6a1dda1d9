"""Rows a trainer writes, held in its own memory (write-through).

Each shard has a single writer, so the rows it wrote are exactly what the shard holds until the
next write, unless recovery changes the shard behind its back. ``HeldRows`` keeps, per table, a
dense ``[num_rows, dim + state]`` array and each row's state (unknown, held, known never written), for the rows of the shards this
trainer writes: an update reads current rows (weights and optimizer state) from here instead of
re-reading them from Redis, and a stage of the next batch reads them from here too. Rows enter
only after the write that put them on their shard succeeded; any restore, rollback or reconnect
of a shard forgets everything (``clear``), and the next reads go to Redis again.

Tables whose array would not fit ``budget_bytes`` (with those before them) are not held.
"""

from __future__ import annotations

import threading

import numpy as np

from embeddings.tables import TableSet

UNKNOWN, HELD, ABSENT = 0, 1, 2  # ABSENT: read as never written; only its writer could write it


class HeldRows:
    def __init__(self, tables: TableSet, widths: list[int], shards: set[int], budget_bytes: int) -> None:
        self.shards = set(shards)
        self._rows: dict[int, np.ndarray] = {}
        self._held: dict[int, np.ndarray] = {}
        used = 0
        for t, spec in enumerate(tables.specs):
            size = spec.num_rows * widths[t] * 4
            if used + size > budget_bytes:
                continue
            used += size
            self._rows[t] = np.empty((spec.num_rows, widths[t]), np.float32)  # pages touched as rows arrive
            self._held[t] = np.zeros(spec.num_rows, np.int8)  # UNKNOWN, HELD or ABSENT
        self.bytes = used
        self.hits = 0
        self.generation = 0  # bumped by clear(): what a read learned before it is void
        self._lock = threading.Lock()

    def holds(self, table: int) -> bool:
        return table in self._rows

    def lookup(self, table: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """-> (positions of ``ids`` held here, their rows, positions known never written), or None
        when the table is not held."""
        state = self._held.get(table)
        if state is None:
            return None
        known = state[ids]
        pos = np.flatnonzero(known == HELD)
        self.hits += len(pos)
        return pos, self._rows[table][ids[pos]], np.flatnonzero(known == ABSENT)

    def put(self, table: int, ids: np.ndarray, rows: np.ndarray) -> None:
        """Rows just written to their shard (one of ``shards``)."""
        if table in self._rows:
            with self._lock:
                self._rows[table][ids] = rows
                self._held[table][ids] = HELD

    def absent(self, table: int, ids: np.ndarray, generation: int) -> None:
        """Rows of ``shards`` that a read (begun at ``generation``) found never written. A row written
        or forgotten since that read began keeps its state."""
        if table in self._held:
            with self._lock:
                if generation != self.generation:
                    return
                state = self._held[table]
                ids = ids[state[ids] == UNKNOWN]
                state[ids] = ABSENT

    def assume_absent(self, table: int, ids: np.ndarray) -> None:
        """Rows known never written (a fresh run's own rows): reads of them need not go to Redis."""
        if table in self._held:
            with self._lock:
                self._held[table][ids] = ABSENT

    def clear(self) -> None:
        with self._lock:
            self.generation += 1
            for state in self._held.values():
                state[:] = UNKNOWN

"""Packed row key -> slot of a bounded row cache, by open addressing over numpy arrays.

Every operation takes a batch of keys and loops over probe rounds (a few at a load factor of at most
one half), not over keys. The table holds slot numbers only (4 bytes a bucket); a bucket matches a
key when the slot it names holds that key (``slot_keys``, the cache's own array). Removed entries
leave a tombstone (probes go on past it, inserts reuse it); the table is rebuilt when tombstones
reach a quarter of it.

Why not torchrec's managed-collision modules or fbgemm's cache kernels: the first remap feature ids
of a KJT into a fixed range and reset evicted rows (a model's view, not a cache of rows that live
elsewhere and must be written back exactly); fbgemm's LRU/LFU cache lookups run on CUDA only.
"""

from __future__ import annotations

import numpy as np

EMPTY, GONE = -1, -2
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


class KeyIndex:
    def __init__(self, capacity: int, slot_keys: np.ndarray) -> None:
        self.bits = max(4, int(2 * max(capacity, 1) - 1).bit_length())  # at least 2x the slots
        self.table = np.full(1 << self.bits, EMPTY, np.int32)
        self.mask = (1 << self.bits) - 1
        self.slot_keys = slot_keys  # slot -> its key (the cache's array; -1 where free)
        self.gone = 0

    @property
    def nbytes(self) -> int:
        return self.table.nbytes

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return ((keys.astype(np.uint64) * _GOLDEN) >> np.uint64(64 - self.bits)).astype(np.int64)

    def _find(self, keys: np.ndarray) -> np.ndarray:
        """The bucket of each key, or -1."""
        out = np.full(len(keys), -1, np.int64)
        todo, b, k = np.arange(len(keys)), self._home(keys), keys
        while len(todo):
            s = self.table[b]
            hit = s >= 0
            hit[hit] = self.slot_keys[s[hit]] == k[hit]
            out[todo[hit]] = b[hit]
            go = ~hit & (s != EMPTY)
            todo, b, k = todo[go], (b[go] + 1) & self.mask, k[go]
        return out

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each key, or -1."""
        keys = np.asarray(keys, np.int64)
        at = self._find(keys)
        return np.where(at >= 0, self.table[np.maximum(at, 0)], -1)

    def insert(self, keys: np.ndarray, slots: np.ndarray) -> None:
        """Unique keys not in the index, with their slots (whose ``slot_keys`` are set already)."""
        todo, b = np.arange(len(keys)), self._home(np.asarray(keys, np.int64))
        while len(todo):
            s = self.table[b]
            free = np.flatnonzero(s < 0)
            # several keys may reach one free bucket in a round: the first takes it, the rest go on
            _, first = np.unique(b[free], return_index=True)
            won = free[first]
            wb = b[won]
            self.gone -= int((self.table[wb] == GONE).sum())
            self.table[wb] = slots[todo[won]]
            rest = np.ones(len(todo), bool)
            rest[won] = False
            todo, b = todo[rest], (b[rest] + 1) & self.mask

    def remove(self, keys: np.ndarray) -> None:
        """Keys leave the index (call before their slots are reused)."""
        at = self._find(np.asarray(keys, np.int64))
        at = at[at >= 0]
        self.table[at] = GONE
        self.gone += len(at)
        if self.gone > len(self.table) // 4:
            self._rebuild()

    def _rebuild(self) -> None:
        slots = self.table[self.table >= 0]
        self.table.fill(EMPTY)
        self.gone = 0
        self.insert(self.slot_keys[slots], slots)

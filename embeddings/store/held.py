"""Rows a trainer writes, cached in its own memory within a budget (write-through).

Each shard has a single writer, so the rows it wrote are exactly what the shard holds until the
next write, unless recovery changes the shard behind its back. ``HeldRows`` is a bounded cache of
those rows: ``capacity`` slots (``budget_bytes`` over the bytes a slot costs, index included), found
by packed row key through a vectorised hash index (``embeddings.keyindex``), each holding a row
(weights and optimizer state) and its state (unknown, held, known never written). An update reads
current rows from here instead of from Redis, and a stage of the next batch reads them here too.

Rows enter after the write that put them on their shard succeeded, or from a read of their shard
(``found``, ``absent``). A row leaves the cache only when its latest value is on its shard: every
write is written through before (or, with write-behind, while: a read from Redis waits for the write
in flight) the next step; the rows of an open write-behind window, which are not on their shard
yet, are pinned until the window is written (``put_keys(pin=True)``, ``unpin``). Eviction suits a
Zipf stream: each slot counts its reads (halved at each eviction round, so the counts follow the
stream), and when free slots run out the least read slots not touched in this step or the last go,
a sixteenth of the cache at a time: hot rows stay, cold rows pass through.

A restore, rollback or reconnect of a shard forgets that shard's rows (``clear(shard)``), whose
next reads go to Redis again; the other shards' rows stay. A restore that brought the shard back to
exactly what its writer wrote (a log replay) holds them again (``reinstate``); a restore to an
earlier step holds again the rows last written before that step, and knows the rows first written
after it as never written (``restored``), so only the rest are read back. With ``init`` (the lazy
init of packed keys), a row known never written holds its initial value. A fresh run's shards
(``assume_fresh``) hold no row yet: a row of theirs this writer never wrote (one bit per row of the
held tables) is known never written without a read.

Tables whose row width differs from the first table's are not held.
"""

from __future__ import annotations

import threading

import numpy as np

from embeddings import rowkeys
from embeddings.keyindex import KeyIndex
from embeddings.store.held_restores import HeldRestores
from embeddings.tables import TableSet


def put_rows(dst: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
    """``dst[at] = rows`` for C-contiguous float32 [n, width] arrays, each row moved as one item
    (a third less time than numpy's element-wise fancy assignment for 17-float rows)."""
    if not rows.flags.c_contiguous or rows.dtype != dst.dtype:
        rows = np.ascontiguousarray(rows, dst.dtype)
    item = np.dtype((np.void, dst.dtype.itemsize * dst.shape[1]))
    dst.view(item).reshape(-1)[at] = rows.view(item).reshape(-1)


FREE, UNKNOWN, HELD, ABSENT = 0, 1, 2, 3  # ABSENT: read as never written; only its writer could write it
PREFILL_ROWS = 1 << 18  # rows initialised at a time by a fresh run's prefill (``HeldRows._prefill``)
PREFILL_MAX_ROWS = 1 << 23  # held tables of more rows are not prefilled (about 1 s per million rows)
NEVER = np.iinfo(np.int32).max  # a row's last write at an unknown step: never assumed older than a restore
# bytes a slot costs beside its row: key 8, first/last write steps 8, touched 4, free list 4, state,
# owner, reads and pin 5, and 2 to 4 index buckets of 4 bytes
SLOT_OVERHEAD = 8 + 8 + 4 + 4 + 5 + 16


class HeldRows:
    def __init__(
        self,
        tables: TableSet,
        widths: list[int],
        shards: set[int],
        budget_bytes: int,
        owner_of=None,
        init=None,
        owner_of_keys=None,
        num_shards: int | None = None,
    ) -> None:
        """``owner_of(table, ids)``: the shard of each row (``ShardMap.shard_of``), so that a shard's
        rows can be forgotten alone; without it ``clear`` forgets every row. ``owner_of_keys(keys)``:
        the same for packed keys of every table at once (``ShardMap.shard_of_keys``), faster.
        ``init(keys)``: the initial rows [n, width] of packed keys (lazy-init weights, zero optimizer
        state). ``num_shards``: the store's (this writer writes every shard: no owner needed to tell a
        fresh shard's row)."""
        self.shards = set(shards)
        self._tables = tables
        self._every_shard = num_shards is not None and self.shards >= set(range(num_shards))
        self._init = init
        self._owner_of = owner_of
        self._owner_of_keys = owner_of_keys
        self.width = widths[0]
        self._held = np.array([w == self.width for w in widths], bool)
        num_rows = np.array([spec.num_rows for spec in tables.specs], np.int64)
        self.table_rows = int(num_rows[self._held].sum())
        # per held table, where its rows start in the one-bit-per-row map of a fresh run's writes
        self._base = np.concatenate([[0], np.cumsum(np.where(self._held, num_rows, 0))])[:-1]
        self._key_offset = self._base - (np.arange(len(num_rows), dtype=np.int64) << rowkeys.ROW_BITS)
        slot_bytes = self.width * 4 + SLOT_OVERHEAD
        self.capacity = int(min(self.table_rows, budget_bytes // slot_bytes))
        c = self.capacity
        self._key = np.full(c, -1, np.int64)
        # every page is touched now, as an engine that allocates its tables does: left to the first
        # write of each row, a step that writes thousands of new rows faults in a page for each
        self._rows = np.empty((c, self.width), np.float32)
        self._rows.fill(0.0)
        self._state = np.full(c, 0, np.int8)  # touched now (np.zeros would fault pages in mid-run)
        # per slot, the step of this writer's first write since the row was known never written (-1:
        # it may have existed before) and of its last write (NEVER: unknown): what a restore to an
        # earlier step left of the row is known without reading it (``restored``)
        self._first = np.full(c, -1, np.int32)
        self._last = np.full(c, NEVER, np.int32)
        self._owner = np.full(c, 0, np.int16)  # touched now (np.zeros would fault pages in mid-run)
        self._reads = np.full(c, 0, np.uint8)  # touched now (np.zeros would fault pages in mid-run)
        self._touched = np.full(c, 0, np.int32)  # touched now (np.zeros would fault pages in mid-run)
        self._pinned = np.full(c, 0, bool)  # touched now (np.zeros would fault pages in mid-run)
        # every row fits: a row's slot is its position among the held tables' rows (no index, no
        # eviction); else slots are handed out from a free stack and found through the hash index
        self._direct = c >= self.table_rows
        self._free = np.empty(0, np.int32) if self._direct else np.arange(c, dtype=np.int32)[::-1].copy()
        self._nfree = c  # the free stack is _free[:_nfree] (direct: the slots never used)
        self._index = None if self._direct else KeyIndex(c, self._key)
        self._memo: tuple | None = None  # (keys, their slots, eviction round): a step's write finds its read's
        self.bytes = c * slot_bytes
        self._fresh: set[int] = set()
        self._written: np.ndarray | None = None  # a fresh run: one bit per row this writer wrote
        self.hits = 0
        self.lookups = 0  # keys looked up: hits / lookups is the hit rate
        self.evicted = 0
        self.grown = 0  # slots added beyond the budget for open windows (``_grow``)
        self.epoch = 0  # the newest step written: rows touched in it or the step before are not evicted
        self.generation = 0  # bumped by clear(): what a read learned before it is void
        self.version = 0  # bumped by every change: a read of rows held at this version is still current
        self._lock = threading.RLock()
        self.restores = HeldRestores(self)  # what a restore of a shard leaves of its rows

    # -- what is held --------------------------------------------------------------------------
    def holds_all(self) -> bool:
        """Every table is held (a bounded number of its rows at a time)."""
        return bool(self._held.all()) and self.capacity > 0

    def holds_everything(self) -> bool:
        """Every row of every table fits: nothing is ever evicted."""
        return self.holds_all() and self.capacity >= self.table_rows

    def holds(self, table: int) -> bool:
        return bool(self._held[table]) and self.capacity > 0

    def stats(self) -> dict:
        return {
            "capacity_rows": self.capacity,
            "table_rows": self.table_rows,
            "bytes": self.bytes,
            "hits": self.hits,
            "lookups": self.lookups,
            "evicted": self.evicted,
            "grown": self.grown,
        }

    @property
    def used(self) -> int:
        return self.capacity - self._nfree

    def _slots(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each packed key, or -1 (under ``_lock``)."""
        memo = self._memo
        if memo is not None and memo[2] == self.evicted and (memo[0] is keys):
            return memo[1]
        if not self.capacity:
            return np.full(len(keys), -1, np.int64)
        if self._direct:
            pos = self._flat(keys)
            slots = np.where(self._key[pos] == keys, pos, -1)
        else:
            slots = self._index.lookup(keys)
        self._memo = (keys, slots, self.evicted)
        return slots

    def _flat(self, keys: np.ndarray) -> np.ndarray:
        """Each key's position among the held tables' rows: ``base[table] + id``, as key + offset."""
        return keys + self._key_offset[keys >> rowkeys.ROW_BITS]

    def _states(self, slots: np.ndarray) -> np.ndarray:
        return np.where(slots >= 0, self._state[np.maximum(slots, 0)], FREE)

    def _read(self, slots: np.ndarray) -> None:
        """Slots just read: one more read each (saturating), touched in this step. (Every row fits:
        nothing is ever evicted, so nothing is counted.)"""
        if self._direct:
            return
        r = self._reads[slots]
        self._reads[slots] = r + (r < 255)
        self._touched[slots] = self.epoch

    def _never_written(self, keys: np.ndarray) -> np.ndarray:
        """Per key not cached: known never written (a fresh shard's row this writer never wrote)."""
        if self._written is None or not len(keys):
            return np.zeros(len(keys), bool)
        tables, ids = rowkeys.unpack(keys)
        fresh = self._held[tables]
        if not (self._every_shard and self._fresh >= self.shards):
            fresh &= np.isin(self._owners(keys), list(self._fresh))
        bit = self._base[tables] + ids
        written = (self._written[bit >> 3] >> (bit & 7).astype(np.uint8)) & 1
        return fresh & (written == 0)

    def _owners(self, keys: np.ndarray) -> np.ndarray:
        if self._owner_of_keys is not None:
            return self._owner_of_keys(keys).astype(np.int16)
        if self._owner_of is None:
            return np.zeros(len(keys), np.int16)
        tables = keys >> rowkeys.ROW_BITS
        out = np.empty(len(keys), np.int16)
        for t in np.unique(tables).tolist():
            at = np.flatnonzero(tables == t)
            out[at] = self._owner_of(t, keys[at] & rowkeys.ROW_MASK)
        return out

    def state_of(self, keys: np.ndarray) -> np.ndarray:
        """UNKNOWN, HELD or ABSENT per packed key (not cached: UNKNOWN unless known never written)."""
        with self._lock:
            keys = np.asarray(keys, np.int64)
            st = self._states(self._slots(keys))
            st[(st == FREE) & self._never_written(keys)] = ABSENT
            st[st == FREE] = UNKNOWN
            return st

    # -- reads ---------------------------------------------------------------------------------
    def lookup_keys(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (positions of ``keys`` held here, their rows [n, width], positions known never written)."""
        with self._lock:
            slots = self._slots(keys)
            st = self._states(slots)
            pos = np.flatnonzero(st == HELD)
            at = slots if len(pos) == len(keys) else slots[pos]
            rows = np.take(self._rows, at, axis=0)
            cached = slots >= 0
            self._read(slots[cached])
            self.lookups += len(keys)
            absent = st == ABSENT
            if not cached.all() and self._written is not None:
                absent[~cached] = self._never_written(keys[~cached])
            self.hits += len(pos)
            return pos, rows, np.flatnonzero(absent)

    def read_keys(self, keys: np.ndarray) -> np.ndarray | None:
        """Rows [n, width] of packed keys, when every one is held or known never written (whose value
        is then its initial one); None when any is not, or without ``init``."""
        if self._init is None or not len(keys) or not self.capacity:
            return None
        with self._lock:
            slots = self._slots(keys)
            st = self._states(slots)
            if bool((st == UNKNOWN).any()):
                return None
            miss = np.flatnonzero(slots < 0)
            if len(miss) and not self._never_written(keys[miss]).all():
                return None
            rows = np.take(self._rows, np.maximum(slots, 0), axis=0)
            if len(miss):
                rows[miss] = self._init(keys[miss])
            self._read(slots[slots >= 0])
            self.hits += len(keys) - len(miss)
            self.lookups += len(keys)
            return rows

    def copy_rows(self, keys: np.ndarray) -> np.ndarray | None:
        """A copy of the rows of packed keys, when every one is held (not counted as a read: the
        rows go to their shards); else None."""
        with self._lock:
            slots = self._slots(keys)
            if not len(slots) or slots.min() < 0 or not bool(np.all(self._state[slots] == HELD)):
                return None
            return np.take(self._rows, slots, axis=0)

    def lookup(self, table: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """-> (positions of ``ids`` held here, their rows, positions known never written), or None
        when the table is not held."""
        if not self.holds(table):
            return None
        return self.lookup_keys(rowkeys.pack(table, np.asarray(ids, np.int64)))

    # -- writes --------------------------------------------------------------------------------
    def put_keys(self, keys: np.ndarray, rows: np.ndarray, step: int | None = None, pin: bool = False) -> None:
        """Rows just written to their shard (one of ``shards``), by the training step ``step`` (None:
        a write outside the steps, whose step no restore can be compared with). ``pin``: rows not on
        their shard yet (an open window's): they stay until ``unpin``."""
        keys = np.asarray(keys, np.int64)
        if self.capacity:
            tables = keys >> rowkeys.ROW_BITS
            mine = self._held[tables]
            if not mine.all():
                keys, rows = keys[mine], rows[mine]
        if not self.capacity or not len(keys):
            return
        with self._lock:
            self.version += 1
            if step is not None:
                self.epoch = max(self.epoch, step)
            slots = self._slots(keys)
            have = np.flatnonzero(slots >= 0)
            s = slots[have] if len(have) < len(keys) else slots
            put_rows(self._rows, s, rows[have] if len(have) < len(keys) else rows)
            if step is None:
                self._first[s], self._last[s] = -1, NEVER
            else:
                state = self._state[s]
                fresh = state != HELD  # mostly none on a step's path: one mask, no index arrays
                if fresh.any():  # a first write: absent at any earlier step; unknown: may have existed
                    self._first[s[fresh]] = np.where(state[fresh] == ABSENT, step, -1)
                self._last[s] = step
            self._state[s] = HELD
            if not self._direct:
                self._touched[s] = self.epoch
            if pin:
                self._pinned[s] = True
            new = np.flatnonzero(slots < 0)
            if len(new):
                k = keys[new]
                first = np.full(len(new), -1, np.int32)
                if step is not None:
                    first[self._never_written(k)] = step
                last = np.full(len(new), NEVER if step is None else step, np.int32)
                self._admit(k, rows[new], HELD, first, last, pin)
            self._mark_written(keys)

    def _mark_written(self, keys: np.ndarray) -> None:
        if self._written is None:
            return
        tables, ids = rowkeys.unpack(keys)
        bit = self._base[tables] + ids
        np.bitwise_or.at(self._written, bit >> 3, (1 << (bit & 7)).astype(np.uint8))

    def put(self, table: int, ids: np.ndarray, rows: np.ndarray) -> None:
        if self.holds(table):
            self.put_keys(rowkeys.pack(table, np.asarray(ids, np.int64)), rows)

    def unpin(self, keys: np.ndarray) -> None:
        """An open window's rows are on their shards now: they may leave like any other."""
        with self._lock:
            slots = self._slots(np.asarray(keys, np.int64))
            self._pinned[slots[slots >= 0]] = False

    def _admit(self, keys, rows, state: int, first, last, pin: bool) -> None:
        """New keys into free slots, evicting where none are free. Rows that do not fit pass through
        (they are on their shards); pinned rows that do not fit grow the cache (``_grow``)."""
        if self._nfree < len(keys):
            self._evict(len(keys) - self._nfree)
        if self._nfree < len(keys) and pin:  # an open window's rows exist nowhere else: the cache grows
            self._grow(len(keys) - self._nfree)
        n = min(len(keys), self._nfree)
        if not n:
            return
        if self._direct:
            slots = self._flat(keys[:n])
        else:
            slots = self._free[self._nfree - n : self._nfree][::-1].astype(np.int64)
        self._nfree -= n
        keys = keys[:n]
        self._key[slots] = keys
        if rows is None:
            if self._init is not None:
                put_rows(self._rows, slots, self._init(keys))
            else:
                self._rows[slots] = 0.0
        else:
            put_rows(self._rows, slots, rows[:n])
        self._state[slots] = state
        self._first[slots], self._last[slots] = first[:n], last[:n]
        self._owner[slots] = self._owners(keys)
        self._reads[slots] = 1
        self._touched[slots] = self.epoch
        self._pinned[slots] = pin
        self._memo = None
        if self._index is not None:
            self._index.insert(keys, slots)

    def _grow(self, extra: int) -> None:
        """At least ``extra`` more slots (the cache doubles): an open write-behind window's rows are
        on no shard yet, so the cache holds them all, beyond its budget if it must. The most a run
        holds beyond it is one window's distinct rows (``write_every`` steps of a batch's rows)."""
        old, new = self.capacity, max(2 * self.capacity, self.capacity + extra, 16)
        for name in ("_key", "_rows", "_state", "_first", "_last", "_owner", "_reads", "_touched", "_pinned"):
            a = getattr(self, name)
            b = np.empty((new, *a.shape[1:]), a.dtype)
            b[:old] = a
            fill = {"_key": -1, "_first": -1, "_last": NEVER}.get(name, 0)
            b[old:] = fill
            setattr(self, name, b)
        free = np.empty(new, np.int32)
        free[: self._nfree] = self._free[: self._nfree]
        added = np.arange(new - 1, old - 1, -1, dtype=np.int32)
        free[self._nfree : self._nfree + len(added)] = added
        self._free, self._nfree, self.capacity = free, self._nfree + len(added), new
        self.bytes += (new - old) * (self.width * 4 + SLOT_OVERHEAD)
        index = KeyIndex(new, self._key)
        used = np.flatnonzero(self._state != FREE)
        index.insert(self._key[used], used)
        self._index = index
        self.grown += new - old

    def _evict(self, need: int) -> None:
        """Free at least ``need`` slots (and up to a sixteenth of the cache), least read first among
        those not pinned and not touched in this step or the last (forgotten rows before any)."""
        used = self._state != FREE
        can = used & ~self._pinned & (self._touched < self.epoch - 1)
        cand = np.flatnonzero(can)
        if not len(cand):
            return
        k = min(len(cand), max(need, self.capacity // 16))
        score = np.where(self._state[cand] == UNKNOWN, -1, self._reads[cand].astype(np.int16))
        go = cand[np.argpartition(score, k - 1)[:k]] if k < len(cand) else cand
        self._index.remove(self._key[go])
        self._key[go] = -1
        self._state[go] = FREE
        self._free[self._nfree : self._nfree + len(go)] = go
        self._nfree += len(go)
        self.evicted += len(go)
        self._reads >>= 1  # older reads count half: the counts follow the stream

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
        """What a read learned of rows unknown (or not cached): their values (``rows``), or that they
        are absent."""
        if not self.holds(table) or not len(ids):
            return
        keys = rowkeys.pack(table, np.asarray(ids, np.int64))
        with self._lock:
            if generation != self.generation:
                return
            self.version += 1
            slots = self._slots(keys)
            st = self._states(slots)
            unknown = np.flatnonzero(st == UNKNOWN)
            s = slots[unknown]
            if rows is not None:
                put_rows(self._rows, s, rows[unknown])
                self._first[s], self._last[s] = -1, NEVER  # read: its writes' steps unknown
                self._state[s] = HELD
            else:
                self._set_absent(s)
            new = np.flatnonzero(slots < 0)
            if len(new):
                n = len(new)
                if rows is not None:
                    self._admit(
                        keys[new], rows[new], HELD, np.full(n, -1, np.int32), np.full(n, NEVER, np.int32), False
                    )
                else:
                    self._admit(keys[new], None, ABSENT, np.full(n, -1, np.int32), np.full(n, NEVER, np.int32), False)

    def _set_absent(self, slots: np.ndarray) -> None:
        """Cached rows known never written: with ``init``, they hold their initial values (under ``_lock``)."""
        self._state[slots] = ABSENT
        if self._init is not None and len(slots):
            put_rows(self._rows, slots, self._init(self._key[slots]))

    def assume_fresh(self, shards: set[int]) -> None:
        """A fresh run: ``shards`` hold no row yet; a row of theirs this writer has not written is known
        never written (one bit per row of the held tables, set as rows are written)."""
        with self._lock:
            self.version += 1
            self._fresh = set(shards)
            if self._written is None:
                self._written = np.zeros((self.table_rows + 7) // 8 + 1, np.uint8)
            every = self._every_shard and self._fresh >= self.shards
            if self._direct and self._init is not None and every and self.table_rows <= PREFILL_MAX_ROWS:
                self._prefill()

    def _prefill(self) -> None:
        """Every row fits and none was ever written (a fresh run whose every shard this writer
        writes): each free slot takes its row's initial value now, known never written, as an engine
        that allocates its tables initialises them, so that no step computes a row's initial value
        on its path (under ``_lock``). Up to ``PREFILL_MAX_ROWS`` rows: beyond, the run's start would
        wait for minutes, and the rows are initialised as steps first read them."""
        num_rows = [spec.num_rows for spec in self._tables.specs]
        for t in np.flatnonzero(self._held).tolist():
            for lo in range(0, num_rows[t], PREFILL_ROWS):
                ids = np.arange(lo, min(num_rows[t], lo + PREFILL_ROWS), dtype=np.int64)
                free = self._state[self._base[t] + ids] == FREE
                keys = rowkeys.pack(t, ids if free.all() else ids[free])
                n = len(keys)
                self._admit(keys, None, ABSENT, np.full(n, -1, np.int32), np.full(n, NEVER, np.int32), False)
        # every row has its slot for good (a direct cache frees none): the one-bit-per-row map of a
        # fresh run's writes is never asked again, so no write marks it
        self._written = None

    def assume_absent(self, table: int, ids: np.ndarray) -> None:
        """Rows known never written, held as such (with their initial values) while they fit."""
        if self.holds(table):
            keys = rowkeys.pack(table, np.asarray(ids, np.int64))
            with self._lock:
                self.version += 1
                slots = self._slots(keys)
                self._set_absent(slots[slots >= 0])
                new = slots < 0
                n = int(new.sum())
                self._admit(keys[new], None, ABSENT, np.full(n, -1, np.int32), np.full(n, NEVER, np.int32), False)

"""The slots of the row cache (``embeddings.store.row_cache.HeldRows``): the rows, their keys and
states, the free stack and hash index that find them, and eviction. The cache's policy (what is
held, what a read or write tells it) is ``HeldRows``; what a restore leaves of the rows is
``embeddings.store.row_cache_restores.HeldRestores``; both work on these slots under ``lock``."""

from __future__ import annotations

import threading

import numpy as np

from embeddings import rowkeys
from embeddings.keyindex import KeyIndex


def put_rows(dst: np.ndarray, at: np.ndarray, rows: np.ndarray) -> None:
    """``dst[at] = rows`` for C-contiguous float32 [n, width] arrays, each row moved as one item
    (a third less time than numpy's element-wise fancy assignment for 17-float rows)."""
    if not rows.flags.c_contiguous or rows.dtype != dst.dtype:
        rows = np.ascontiguousarray(rows, dst.dtype)
    item = np.dtype((np.void, dst.dtype.itemsize * dst.shape[1]))
    dst.view(item).reshape(-1)[at] = rows.view(item).reshape(-1)


FREE, UNKNOWN, HELD, ABSENT = 0, 1, 2, 3  # ABSENT: read as never written; only its writer could write it
NEVER = np.iinfo(np.int32).max  # a row's last write at an unknown step: never assumed older than a restore
# bytes a slot costs beside its row: key 8, first/last write steps 8, touched 4, free list 4, state,
# owner, reads and pin 5, and 2 to 4 index buckets of 4 bytes
SLOT_OVERHEAD = 8 + 8 + 4 + 4 + 5 + 16


# every per-slot array: its dtype and the value of a free slot
_FIELDS = {
    "key": (np.int64, -1),
    "rows": (np.float32, 0.0),
    "state": (np.int8, FREE),
    "first": (np.int32, -1),
    "last": (np.int32, NEVER),
    "owner": (np.int16, 0),
    "_reads": (np.uint8, 0),
    "_touched": (np.int32, 0),
    "_pinned": (bool, False),
}
_spare: list[dict[str, np.ndarray]] = []  # the arrays of the last cache released in this process
_keep: list[bool] = [False]  # whether a released cache's arrays are kept (``keep_released``)
# the last cache closed in this process, whole: (its namespace, its ``HeldRows``) (``RowCache.release``)
carried: list[tuple] = []


def keep_released(on: bool = True) -> None:
    """A process that builds its caches again and again (a trainer under ``--trainer-recovery
    replace`` regroups in its process) keeps the arrays of the one it released for the next (off:
    none is kept, and the one kept goes)."""
    _keep[0] = on
    if not on:
        _spare.clear()
        carried.clear()


def keeps_released() -> bool:
    """Whether this process builds its caches again (``keep_released``)."""
    return _keep[0]


def _take_spare(capacity: int, width: int) -> dict[str, np.ndarray] | None:
    """The released arrays of a cache of ``capacity`` slots of ``width`` floats, once; else None."""
    if _spare and _spare[0]["rows"].shape == (capacity, width):
        return _spare.pop()
    return None


class RowSlots:
    """The slots of a row cache: per slot a packed key, its row, its state and what eviction and a
    restore go by; found by key (``find``), admitted (``admit``), evicted, grown for open windows.
    Every field is guarded by ``lock``; ``generation`` and ``version`` are what a read compares."""

    key: np.ndarray  # per slot (``_FIELDS``): its packed key (-1: free)
    rows: np.ndarray  # [capacity, width]: its row
    state: np.ndarray
    # the step of this writer's first write since the row was known never written (-1: it may have
    # existed before) and of its last write (NEVER: unknown): what a restore to an earlier step left
    # of the row is known without reading it (``restored``)
    first: np.ndarray
    last: np.ndarray
    owner: np.ndarray  # its shard
    _reads: np.ndarray
    _touched: np.ndarray
    _pinned: np.ndarray
    hits: int  # keys found held (the cache's counters: ``HeldRows``)
    lookups: int

    def __init__(self, capacity: int, width: int, direct: bool, key_offset: np.ndarray, init, owners) -> None:
        """``direct``: every row fits, a row's slot is its position among the held tables' rows
        (``key_offset`` per table; no index, no eviction). ``init(keys)``: initial rows of packed keys
        (None: zeros); ``owners(keys)``: the shard of each packed key."""
        self.capacity = c = capacity
        self.width = width
        self._init = init
        self._owners_of = owners
        self._key_offset = key_offset
        # every page is touched now, as an engine that allocates its tables does: left to the first
        # write of each row, a step that writes thousands of new rows faults in a page for each (np.zeros
        # would fault them in mid-run). A cache released in this process (``release``: a regroup
        # builds its trainer again) hands its arrays on, touched already: only the bookkeeping is reset
        # (every row is written when its slot is taken: what a freed slot's row held is never read)
        spare = _take_spare(c, width)
        for name, (dtype, fill) in _FIELDS.items():
            if spare is not None:
                a = spare[name]
                if name != "rows":
                    a.fill(fill)
            else:
                a = np.empty((c, width) if name == "rows" else c, dtype)
                a.fill(fill)
            setattr(self, name, a)
        # every row fits: a row's slot is its position among the held tables' rows (no index, no
        # eviction); else slots are handed out from a free stack and found through the hash index
        self._direct = direct
        self._free = np.empty(0, np.int32) if self._direct else np.arange(c, dtype=np.int32)[::-1].copy()
        self._nfree = c  # the free stack is _free[:_nfree] (direct: the slots never used)
        self._index = None if self._direct else KeyIndex(c, self.key)
        self._memo: tuple | None = None  # (keys, their slots, eviction round): a step's write finds its read's
        self.bytes = c * (width * 4 + SLOT_OVERHEAD)
        self.evicted = 0
        self.grown = 0  # slots added beyond the budget for open windows (``_grow``)
        self.epoch = 0  # the newest step written: rows touched in it or the step before are not evicted
        self.generation = 0  # bumped by clear(): what a read learned before it is void
        self.version = 0  # bumped by every change: a read of rows held at this version is still current
        self.lock = threading.RLock()

    def release(self) -> None:
        """The cache's store closed: its arrays go to the next cache of its size built in this process
        (``recsys.quorum.regroup`` builds its trainer again in the same process), and this one holds
        none from now on: a late call fails (an index error) rather than read another cache's rows."""
        with self.lock:
            if _keep[0] and self.capacity and not self.grown:
                _spare[:] = [{name: getattr(self, name) for name in _FIELDS}]
            for name, (dtype, _) in _FIELDS.items():
                setattr(self, name, np.empty((0, self.width) if name == "rows" else 0, dtype))
            self.capacity = self._nfree = 0
            self._free = np.empty(0, np.int32)
            self._index = None if self._direct else KeyIndex(0, self.key)
            self._memo = None
            self.generation += 1
            self.version += 1

    @property
    def direct(self) -> bool:
        """Every row fits: a row's slot is its position (nothing is ever evicted)."""
        return self._direct

    @property
    def used(self) -> int:
        return self.capacity - self._nfree

    def find(self, keys: np.ndarray) -> np.ndarray:
        """The slot of each packed key, or -1 (under ``_lock``)."""
        memo = self._memo
        if memo is not None and memo[2] == self.evicted and (memo[0] is keys):
            return memo[1]
        if not self.capacity:
            return np.full(len(keys), -1, np.int64)
        if self._direct:
            pos = self._flat(keys)
            slots = np.where(self.key[pos] == keys, pos, -1)
        else:
            slots = self._index.lookup(keys)
        self._memo = (keys, slots, self.evicted)
        return slots

    def read_split(self, keys: np.ndarray, other: RowSlots) -> np.ndarray | None:
        """Rows [n, width] of packed keys, each in its slot here or in ``other`` (the peer rows: the
        other shards' rows of the same tables), when both hold every row of their shards (direct)
        and every one is held or known never written: one gather from each, no look-up by state or
        owner; None when any is not (the general path answers)."""
        if not (self._direct and other._direct and self.capacity and other.capacity and len(keys)):
            return None
        if self._init is None or other._init is None:  # a row known never written holds no initial value
            return None
        if other.width != self.width or not np.array_equal(other._key_offset, self._key_offset):
            return None
        flat = self._flat(keys)
        with self.lock:
            mine = self.key[flat] == keys
            if bool((self.state[flat[mine]] == UNKNOWN).any()):
                return None
            rows = np.take(self.rows, flat, axis=0)
            self.hits += int(mine.sum())
            self.lookups += len(keys)
        theirs = np.flatnonzero(~mine)
        if len(theirs):
            at = flat[theirs]
            with other.lock:
                if not bool(np.all(other.key[at] == keys[theirs])) or bool((other.state[at] == UNKNOWN).any()):
                    return None
                put_rows(rows, theirs, np.take(other.rows, at, axis=0))
                other.hits += len(theirs)
                other.lookups += len(theirs)
        return rows

    def pinned(self, keys: np.ndarray) -> np.ndarray:
        """Whether each packed key is held pinned (an open window's: ``put_keys(pin=True)``)."""
        with self.lock:
            slots = self.find(np.asarray(keys, np.int64))
            return (slots >= 0) & self._pinned[np.maximum(slots, 0)]

    def _flat(self, keys: np.ndarray) -> np.ndarray:
        """Each key's position among the held tables' rows: ``base[table] + id``, as key + offset."""
        return keys + self._key_offset[keys >> rowkeys.ROW_BITS]

    def _states(self, slots: np.ndarray) -> np.ndarray:
        return np.where(slots >= 0, self.state[np.maximum(slots, 0)], FREE)

    def _read(self, slots: np.ndarray) -> None:
        """Slots just read: one more read each (saturating), touched in this step. (Every row fits:
        nothing is ever evicted, so nothing is counted.)"""
        if self._direct:
            return
        r = self._reads[slots]
        self._reads[slots] = r + (r < 255)
        self._touched[slots] = self.epoch

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
        self.key[slots] = keys
        if rows is None:
            if self._init is not None:
                put_rows(self.rows, slots, self._init(keys))
            else:
                self.rows[slots] = 0.0
        else:
            put_rows(self.rows, slots, rows[:n])
        self.state[slots] = state
        self.first[slots], self.last[slots] = first[:n], last[:n]
        self.owner[slots] = self._owners_of(keys)
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
        for name in ("key", "rows", "state", "first", "last", "owner", "_reads", "_touched", "_pinned"):
            a = getattr(self, name)
            b = np.empty((new, *a.shape[1:]), a.dtype)
            b[:old] = a
            fill = {"key": -1, "first": -1, "last": NEVER}.get(name, 0)
            b[old:] = fill
            setattr(self, name, b)
        free = np.empty(new, np.int32)
        free[: self._nfree] = self._free[: self._nfree]
        added = np.arange(new - 1, old - 1, -1, dtype=np.int32)
        free[self._nfree : self._nfree + len(added)] = added
        self._free, self._nfree, self.capacity = free, self._nfree + len(added), new
        self.bytes += (new - old) * (self.width * 4 + SLOT_OVERHEAD)
        index = KeyIndex(new, self.key)
        used = np.flatnonzero(self.state != FREE)
        index.insert(self.key[used], used)
        self._index = index
        self.grown += new - old

    def _evict(self, need: int) -> None:
        """Free at least ``need`` slots (and up to a sixteenth of the cache), least read first among
        those not pinned and not touched in this step or the last (forgotten rows before any)."""
        used = self.state != FREE
        can = used & ~self._pinned & (self._touched < self.epoch - 1)
        cand = np.flatnonzero(can)
        if not len(cand):
            return
        k = min(len(cand), max(need, self.capacity // 16))
        score = np.where(self.state[cand] == UNKNOWN, -1, self._reads[cand].astype(np.int16))
        go = cand[np.argpartition(score, k - 1)[:k]] if k < len(cand) else cand
        self._index.remove(self.key[go])
        self.key[go] = -1
        self.state[go] = FREE
        self._free[self._nfree : self._nfree + len(go)] = go
        self._nfree += len(go)
        self.evicted += len(go)
        self._reads >>= 1  # older reads count half: the counts follow the stream

    def set_absent(self, slots: np.ndarray) -> None:
        """Cached rows known never written: with ``init``, they hold their initial values (under ``_lock``)."""
        self.state[slots] = ABSENT
        if self._init is not None and len(slots):
            put_rows(self.rows, slots, self._init(self.key[slots]))

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

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from embeddings import rowkeys
from embeddings.errors import ShardUnavailableError
from embeddings.store.row_cache_restores import HeldRestores
from embeddings.store.row_slots import (
    ABSENT,
    FREE,
    HELD,
    NEVER,
    SLOT_OVERHEAD,
    UNKNOWN,
    RowSlots,
    carried,
    keeps_released,
    put_rows,
)
from embeddings.tables import TableSet

if TYPE_CHECKING:
    from embeddings.peer_rows import PeerRows

PREFILL_ROWS = 1 << 18  # rows initialised at a time by a fresh run's prefill (``HeldRows._prefill``)
PREFILL_MAX_ROWS = 1 << 23  # held tables of more rows are not prefilled (about 1 s per million rows)

__all__ = ["ABSENT", "FREE", "HELD", "NEVER", "UNKNOWN", "HeldRows", "put_rows"]


class HeldRows(RowSlots):
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
        self.budget_bytes = budget_bytes
        self._tables = tables
        self._every_shard = num_shards is not None and self.shards >= set(range(num_shards))
        self._owner_of = owner_of
        self._owner_of_keys = owner_of_keys
        self.width = widths[0]
        self._held = np.array([w == self.width for w in widths], bool)
        self._every_table = bool(self._held.all())
        num_rows = np.array([spec.num_rows for spec in tables.specs], np.int64)
        self.table_rows = int(num_rows[self._held].sum())
        # per held table, where its rows start in the one-bit-per-row map of a fresh run's writes
        self._base = np.concatenate([[0], np.cumsum(np.where(self._held, num_rows, 0))])[:-1]
        key_offset = self._base - (np.arange(len(num_rows), dtype=np.int64) << rowkeys.ROW_BITS)
        capacity = int(min(self.table_rows, budget_bytes // (self.width * 4 + SLOT_OVERHEAD)))
        super().__init__(capacity, self.width, capacity >= self.table_rows, key_offset, init, self._owners)
        self._fresh: set[int] = set()
        self._written: np.ndarray | None = None  # a fresh run: one bit per row this writer wrote
        self.hits = 0
        self.lookups = 0  # keys looked up: hits / lookups is the hit rate
        # what a restore of a shard leaves of its rows
        self.restores = HeldRestores(self, owner_of is not None, owner_of is not None or owner_of_keys is not None)

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
        with self.lock:
            keys = np.asarray(keys, np.int64)
            st = self._states(self.find(keys))
            st[(st == FREE) & self._never_written(keys)] = ABSENT
            st[st == FREE] = UNKNOWN
            return st

    # -- reads ---------------------------------------------------------------------------------
    def lookup_keys(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (positions of ``keys`` held here, their rows [n, width], positions known never written)."""
        with self.lock:
            slots = self.find(keys)
            st = self._states(slots)
            pos = np.flatnonzero(st == HELD)
            at = slots if len(pos) == len(keys) else slots[pos]
            rows = np.take(self.rows, at, axis=0)
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
        with self.lock:
            slots = self.find(keys)
            if slots.min() >= 0:  # every key has its slot (the usual step): no masks
                if bool((self.state[slots] == UNKNOWN).any()):
                    return None
                rows = np.take(self.rows, slots, axis=0)
                self._read(slots)
                self.hits += len(keys)
                self.lookups += len(keys)
                return rows
            st = self._states(slots)
            if bool((st == UNKNOWN).any()):
                return None
            miss = np.flatnonzero(slots < 0)
            if len(miss) and not self._never_written(keys[miss]).all():
                return None
            rows = np.take(self.rows, np.maximum(slots, 0), axis=0)
            if len(miss):
                rows[miss] = self._init(keys[miss])
            self._read(slots[slots >= 0])
            self.hits += len(keys) - len(miss)
            self.lookups += len(keys)
            return rows

    def copy_rows(self, keys: np.ndarray) -> np.ndarray | None:
        """A copy of the rows of packed keys, when every one is held (not counted as a read: the
        rows go to their shards); else None."""
        with self.lock:
            slots = self.find(keys)
            if not len(slots) or slots.min() < 0 or not bool(np.all(self.state[slots] == HELD)):
                return None
            return np.take(self.rows, slots, axis=0)

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
        if self.capacity and not self._every_table:
            mine = self._held[keys >> rowkeys.ROW_BITS]
            if not mine.all():
                keys, rows = keys[mine], rows[mine]
        if not self.capacity or not len(keys):
            return
        with self.lock:
            self.version += 1
            if step is not None:
                self.epoch = max(self.epoch, step)
            slots = self.find(keys)
            have = np.flatnonzero(slots >= 0)
            s = slots[have] if len(have) < len(keys) else slots
            put_rows(self.rows, s, rows[have] if len(have) < len(keys) else rows)
            if step is None:
                self.first[s], self.last[s] = -1, NEVER
                self.state[s] = HELD
            else:
                state = self.state[s]
                fresh = state != HELD  # mostly none on a step's path: one mask, no index arrays
                if fresh.any():  # a first write: absent at any earlier step; unknown: may have existed
                    self.first[s[fresh]] = np.where(state[fresh] == ABSENT, step, -1)
                    self.state[s] = HELD
                self.last[s] = step
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
        with self.lock:
            slots = self.find(np.asarray(keys, np.int64))
            self._pinned[slots[slots >= 0]] = False

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
        with self.lock:
            if generation != self.generation:
                return
            self.version += 1
            slots = self.find(keys)
            st = self._states(slots)
            unknown = np.flatnonzero(st == UNKNOWN)
            s = slots[unknown]
            if rows is not None:
                put_rows(self.rows, s, rows[unknown])
                self.first[s], self.last[s] = -1, NEVER  # read: its writes' steps unknown
                self.state[s] = HELD
            else:
                self.set_absent(s)
            new = np.flatnonzero(slots < 0)
            if len(new):
                n = len(new)
                if rows is not None:
                    self._admit(
                        keys[new], rows[new], HELD, np.full(n, -1, np.int32), np.full(n, NEVER, np.int32), False
                    )
                else:
                    self._admit(keys[new], None, ABSENT, np.full(n, -1, np.int32), np.full(n, NEVER, np.int32), False)

    def assume_fresh(self, shards: set[int]) -> None:
        """A fresh run: ``shards`` hold no row yet; a row of theirs this writer has not written is known
        never written (one bit per row of the held tables, set as rows are written)."""
        with self.lock:
            self.version += 1
            self._fresh = set(shards)
            if self._written is None:
                self._written = np.zeros((self.table_rows + 7) // 8 + 1, np.uint8)
            # every shard of this cache's (one trainer's, or its peers': their rows told apart by owner)
            owned = self._owner_of_keys is not None or self._owner_of is not None
            every = self._fresh >= self.shards and (self._every_shard or owned)
            if self._direct and self._init is not None and every and self.table_rows <= PREFILL_MAX_ROWS:
                self._prefill()

    def begin_learning(self) -> int:
        """Before a resumed run lists the rows on its shards (``embeddings.store.present``): every
        row written from now on is marked. -> the generation the listing begins at."""
        with self.lock:
            if self._written is None:
                self._written = np.zeros((self.table_rows + 7) // 8 + 1, np.uint8)
            return self.generation

    def invalidate(self) -> None:
        """What a read or a listing begun before learns nothing (a shard may change behind this
        writer's back: another trainer's recovery began)."""
        with self.lock:
            self.generation += 1
            self.version += 1

    def assume_present(self, present: dict[int, np.ndarray], generation: int) -> bool:
        """A resumed run: ``present`` is every row (packed keys) on each of those shards, listed
        after recovery brought them back to the step it resumed from (``begin_learning`` at
        ``generation``); a row of theirs not listed, and not written by this writer since the
        listing began, is known never written, as in a fresh run (``assume_fresh``). Nothing is
        learned when a shard was forgotten since (a restore, a rollback). -> whether it was learned."""
        with self.lock:
            if generation != self.generation or not present or self._written is None:
                return False
            self.version += 1
            keys = np.concatenate(list(present.values()))
            self._mark_written(keys[self._held[keys >> rowkeys.ROW_BITS]])
            self._fresh |= set(present)
            return True

    def _prefill(self) -> None:
        """Every row fits and none of its shards' was ever written (a fresh run; the shards this
        writer writes, or with several trainers the others' shards kept here as peer rows): each
        free slot of a row of those shards takes its row's initial value now, known never written,
        as an engine that allocates its tables initialises them, so that no step computes a row's
        initial value, or asks whether it was ever written, on its path (under ``_lock``). Up to
        ``PREFILL_MAX_ROWS`` rows: beyond, the run's start would wait for minutes, and the rows are
        initialised as steps first read them."""
        num_rows = [spec.num_rows for spec in self._tables.specs]
        mine = None if self._every_shard else np.array(sorted(self.shards), np.int16)
        for t in np.flatnonzero(self._held).tolist():
            for lo in range(0, num_rows[t], PREFILL_ROWS):
                ids = np.arange(lo, min(num_rows[t], lo + PREFILL_ROWS), dtype=np.int64)
                free = self.state[self._base[t] + ids] == FREE
                if mine is not None:  # only its shards' rows: another shard's row is no business of this cache
                    free &= np.isin(self._owners(rowkeys.pack(t, ids)), mine)
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
            with self.lock:
                self.version += 1
                slots = self.find(keys)
                self.set_absent(slots[slots >= 0])
                new = slots < 0
                n = int(new.sum())
                self._admit(keys[new], None, ABSENT, np.full(n, -1, np.int32), np.full(n, NEVER, np.int32), False)


def _table_rows(space) -> int:
    """The rows of the tables a ``HeldRows`` of ``space`` holds (those of the first table's width)."""
    widths = [space.width(t) for t in range(len(space.tables.specs))]
    return sum(spec.num_rows for spec, w in zip(space.tables.specs, widths) if w == widths[0])


class RowCache:
    """The store's part that owns the rows its trainer holds (``held``: a ``HeldRows``, None until
    ``hold_rows``): starting to hold the rows of the shards it writes, a fresh run's shards known
    empty, what a restore or rollback of a shard forgets of them and what it leaves, and the
    counters of reading them back. One per ``RedisStore``; its front exposes ``row_cache``."""

    def __init__(self, space, shard_map, num_shards: int) -> None:
        self.space, self.shard_map, self.num_shards = space, shard_map, num_shards
        self.held: HeldRows | None = None
        # several trainers: the rows of the shards other trainers write, as this trainer read them
        # and kept current by every step's summed row gradients (``embeddings.peer_rows``); None: none
        self.peers: PeerRows | None = None
        self.taken_over = False  # ``held`` is the cache of the trainer before in this process (``hold_rows``)
        self.reload_s = 0.0  # reading held rows back after their shard was restored (``reload_held``)
        self.reload_kept = self.reload_absent = self.reload_read = (
            0  # rows of restored shards: held again, absent, read
        )

    def hold_rows(self, shards: set[int], budget_bytes: int) -> HeldRows:
        """Keep the rows of ``shards`` (the ones this process writes) in memory as they are written.
        A trainer built again in its process (``--trainer-recovery replace``) that writes the same
        shards within the same budget takes the last one's cache whole (``release``): what it holds
        stands once the resume says where the shards are (``resumed``)."""
        sp = self.space
        while carried:
            namespace, last = carried.pop()
            if (namespace, last.shards, last.budget_bytes, last.table_rows) == (
                sp.namespace,
                set(shards),
                budget_bytes,
                _table_rows(sp),
            ):
                self.held, self.taken_over = last, True
                for s in last.shards:  # rows forgotten before (a failover, a reconnect) are read back, not held again
                    last.restores.drop_forgotten(s)
                return last
            last.release()  # its arrays go to the cache built below, touched already
        self.held = HeldRows(
            sp.tables,
            [sp.width(t) for t in range(len(sp.tables.specs))],
            shards,
            budget_bytes,
            owner_of=self.shard_map.shard_of,
            init=sp.initial_rows,  # held tables share one row width, hence one dim
            owner_of_keys=self.shard_map.shard_of_keys,
            num_shards=self.num_shards,
        )
        return self.held

    def drop_peers(self) -> None:
        """Every peer row forgotten, and what was known never written with them: a recovery, a
        rollback or a shard away changed rows without a step's update reaching them here."""
        peers = self.peers
        if peers is not None:
            peers.restores.clear()
            peers.forget_fresh()

    def release(self, carry: bool = False) -> None:
        """The store closed: the held rows' arrays go to the next cache of their size in this process
        (``RowSlots.release``); with ``carry`` (and ``keep_released`` on, no slot grown for an open
        window), the cache goes whole to the next store of this process that holds the same shards
        (``hold_rows``), and this store holds none from now on."""
        peers, self.peers = self.peers, None
        if peers is not None:
            peers.release()
        held, self.held = self.held, None
        if held is None:
            return
        if carry and keeps_released() and held.capacity and not held.grown:
            carried[:] = [(self.space.namespace, held)]
        else:
            held.release()

    def resumed(self, step: int) -> set[int]:
        """A resumed run, every shard back at ``step`` at most (no write of this trainer's after it
        left on any: a rollback of one step, a restore). A cache taken from the trainer before
        (``hold_rows``) keeps what holds there: every row it holds stands for its shard's current
        value (a restore seen at a commit point forgot the rows it changed), except a row this
        writer wrote after ``step``, which a rollback by another trainer took back behind its back:
        held again if last written at ``step`` or before, known never written if first written after
        it, read back otherwise. Rows known never written stay so (a rollback or restore only takes
        rows away). -> the held shards whose rows are not all known present or absent (to be
        listed: ``embeddings.store.present``)."""
        held = self.held
        if held is None:
            return set()
        if not self.taken_over:
            return set(held.shards)
        self.taken_over = False
        for s in sorted(held.shards):
            held.restores.clear(s)
            held.restores.restored(s, step, step)
        return held.shards - held._fresh  # rows not held known never written (``assume_fresh``, ``assume_present``)

    def forget(self, shard: int | None = None) -> None:
        """A shard changed behind the writers' backs (restore, rollback, failover): its held rows go
        (None: every shard's)."""
        if self.held is not None:
            self.held.restores.clear(shard)
        self.drop_peers()

    def assume_fresh(self, applied_step: Callable[[int], int | None]) -> None:
        """A fresh run: the held shards that never applied a step (``applied_step``) hold none of its
        rows yet, so a row of theirs this writer has not written is known absent (no first read from
        Redis). A shard that does not answer now is assumed nothing of: its rows are read from it
        (the recovery protocol meets its failure at the first such read), as another rank may
        already be in a phase that killed it."""
        held = self.held
        if held is None:
            return
        if self.taken_over:  # a fresh run's shards hold none of the rows the last trainer held
            held.restores.clear()
            self.taken_over = False
        for cache in (held, self.peers):  # its own shards, and the other trainers' (several trainers)
            if cache is None:
                continue
            fresh = set()
            for s in sorted(cache.shards):
                try:
                    if applied_step(s) is None:
                        fresh.add(s)
                except ShardUnavailableError:
                    continue
            if fresh:
                cache.assume_fresh(fresh)

    def reload_held(
        self,
        shard: int,
        fetch: Callable[[dict[int, np.ndarray]], object],
        kept_upto: int | None = None,
        absent_after: int | None = None,
        overlay: tuple[np.ndarray, int] | None = None,
    ) -> int:
        """After a shard was restored: read back (``fetch``, one bulk read) the rows this writer held
        on it, so that the steps after the recovery read them from memory again and its write-behind
        keeps overlapping them; rows no longer on the shard are known never written. With the
        restore's steps (``HeldRestores.restored``), rows unchanged by it are held again without a
        read and rows first written after it are known never written. -> rows read."""
        held = self.held
        if held is None or shard not in held.shards:
            return 0
        t0 = time.perf_counter()
        restores = held.restores
        if kept_upto is None or absent_after is None:
            restores.drop_forgotten(shard)
        else:
            kept, gone = restores.restored(shard, kept_upto, max(kept_upto, absent_after), overlay)
            self.reload_kept += kept
            self.reload_absent += gone
        requests = restores.unknown(shard)
        if requests:
            fetch(requests)
        self.reload_s += time.perf_counter() - t0
        n = sum(len(ids) for ids in requests.values())
        self.reload_read += n
        return n

    def reinstate_held(self, shard: int) -> int:
        """After a shard was restored to exactly what this writer wrote to it (its log replayed up to
        the writer's last step): the rows it held there are held again, no read. -> rows held again."""
        held = self.held
        if held is None or shard not in held.shards:
            return 0
        return held.restores.reinstate(shard)

    def drop_forgotten(self, shard: int) -> None:
        """The rows of ``shard`` forgotten by its restore are not to be held again (it went back to an
        earlier state)."""
        if self.held is not None:
            self.held.restores.drop_forgotten(shard)

    def shard_rows(self, shard: int, width: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the rows held of ``shard`` (``HeldRestores.shard_rows``): (packed keys, rows
        [n, width]); none without held rows."""
        if self.held is None:
            return np.empty(0, np.int64), np.empty((0, width), np.float32)
        return self.held.restores.shard_rows(shard)

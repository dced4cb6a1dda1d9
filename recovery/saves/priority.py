"""CPR's priority saves: between full checkpoints, save each shard's most valuable rows more often.

- ``MFUTracker`` (partial-mfu): each shard's most frequently updated rows, counted by a
  space-saving sketch of a fixed number of rows per shard (bounded memory at any table size).
- ``SSUTracker`` (partial-ssu): sub-sampled update tracking in bounded memory: each update is
  tracked with probability ``fraction`` (so a row updated k times is tracked with probability
  1 - (1 - fraction)^k: hot rows almost surely), and each shard keeps at most ``capacity`` tracked
  rows, the most sampled ones.

``PrioritySaver`` (one per writer, for the shards it writes) copies the selected rows (weights and
optimizer state) from the rows the writer holds at a step boundary; a background thread writes
them to ``{dir}/shard{S}.bin`` (``recovery.durable.rowfiles``: temp, fsync, rename, CRC32C checked on
load), so training pauses for the copy alone. On a partial recovery rank 0 overlays the newest
save taken after the restored checkpoint (``overlay``); the updates those rows received between
the checkpoint and the save are no longer lost. ``RowCounts`` keeps per-row update counts since
the last checkpoint (sparse) to account for exactly that; the count travels in the file.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import numpy as np

from embeddings import rowkeys
from embeddings.store.redis_store import RedisStore
from recovery.durable import layout, rowfiles
from recovery.durable.rowfiles import ShardRowsSaver
from recovery.errors import CorruptCheckpointError


class RowCounts:
    """Updates per row since the last checkpoint (accounting of what a priority save holds), kept
    sparse: memory grows with the rows updated since the checkpoint, not with the tables.

    The training thread only appends (``observe``) and hands the appended keys over (``take``);
    merging and totals run on one other thread (the saver's writer), so they cost no pause."""

    def __init__(self) -> None:
        self.keys = np.empty(0, np.int64)  # sorted
        self.counts = np.empty(0, np.int64)
        self._pending: list[np.ndarray] = []
        self.pending_n = 0

    def observe(self, keys: np.ndarray) -> None:
        """Packed row keys updated once more each."""
        self._pending.append(keys)
        self.pending_n += len(keys)

    def take(self) -> list[np.ndarray]:
        """The keys observed since the last take (to ``merge`` elsewhere)."""
        pending, self._pending, self.pending_n = self._pending, [], 0
        return pending

    def merge(self, chunks: list[np.ndarray]) -> None:
        if not chunks:
            return
        n = sum(len(c) for c in chunks)
        keys = np.concatenate([self.keys, *chunks])
        counts = np.concatenate([self.counts, np.ones(n, np.int64)])
        self.keys, inv = np.unique(keys, return_inverse=True)
        self.counts = np.bincount(inv, weights=counts, minlength=len(self.keys)).astype(np.int64)

    def reset(self) -> None:
        self.keys, self.counts = np.empty(0, np.int64), np.empty(0, np.int64)

    def total(self, groups: list[tuple[int, np.ndarray]]) -> int:
        """Updates of the rows ``groups`` counted so far (merged: call after ``merge``)."""
        if not len(self.keys) or not groups:
            return 0
        keys = np.concatenate([rowkeys.pack(t, ids) for t, ids in groups])
        pos = np.minimum(np.searchsorted(self.keys, keys), len(self.keys) - 1)
        hit = self.keys[pos] == keys
        return int(self.counts[pos[hit]].sum())


class SpaceSaving:
    """Heavy hitters of a key stream in bounded memory (space-saving, merged in batches).

    Holds at most ``2 * capacity`` keys with an over-estimate of their counts. Keys arrive in
    ``add`` (each +1) and are merged in batches; when more than ``2 * capacity`` keys are held, the
    ``capacity`` largest counts stay and ``floor`` becomes the largest count dropped: a key that
    arrives later starts at ``floor`` plus its count, as space-saving would count it. A key whose
    true count exceeds ``floor`` is never dropped, so the top keys of a skewed stream stay.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.keys = np.empty(0, np.int64)  # sorted
        self.counts = np.empty(0, np.int64)
        self.floor = 0
        self._pending: list[np.ndarray] = []
        self._pending_n = 0

    def add(self, keys: np.ndarray) -> None:
        self._pending.append(keys)
        self._pending_n += len(keys)
        if self._pending_n >= 4 * self.capacity:
            self._merge()

    def defer(self, keys: np.ndarray) -> None:
        """``add`` without merging here: the caller merges (``take``, then ``merge`` on its own thread)."""
        self._pending.append(keys)
        self._pending_n += len(keys)

    @property
    def pending_n(self) -> int:
        return self._pending_n

    def take(self) -> list[np.ndarray]:
        """The keys added since the last merge (to ``merge`` elsewhere, e.g. a background thread)."""
        pending, self._pending, self._pending_n = self._pending, [], 0
        return pending

    def _merge(self) -> None:
        self.merge(self.take())

    def merge(self, chunks: list[np.ndarray]) -> None:
        if not chunks:
            return
        new, cnt = np.unique(np.concatenate(chunks), return_counts=True)
        pos = np.searchsorted(self.keys, new)
        found = pos < len(self.keys)
        found[found] = self.keys[pos[found]] == new[found]
        self.counts[pos[found]] += cnt[found]
        if not found.all():
            keys = np.concatenate([self.keys, new[~found]])
            counts = np.concatenate([self.counts, cnt[~found] + self.floor])
            order = np.argsort(keys, kind="stable")
            self.keys, self.counts = keys[order], counts[order]
        if len(self.keys) > 2 * self.capacity:
            keep = np.argpartition(-self.counts, self.capacity - 1)[: self.capacity]
            dropped = np.ones(len(self.keys), bool)
            dropped[keep] = False
            self.floor = max(self.floor, int(self.counts[dropped].max()))
            keep.sort()
            self.keys, self.counts = self.keys[keep], self.counts[keep]

    def top(self, k: int, merge: bool = True) -> tuple[np.ndarray, np.ndarray]:
        """-> (keys, estimated counts) of the (at most) ``k`` most counted keys (``merge``: the keys
        added since the last merge first)."""
        if merge:
            self._merge()
        if len(self.keys) <= k:
            return self.keys, self.counts
        idx = np.argpartition(-self.counts, k - 1)[:k]
        return self.keys[idx], self.counts[idx]


class MFUTracker:
    """Each shard's most frequently updated rows, by a space-saving sketch of ``capacity`` rows per
    shard (memory bounded by the capacity, not by the tables' rows)."""

    def __init__(self, store: RedisStore, capacity: int = 8192, shards: set[int] | None = None) -> None:
        self.store = store
        self.shards = set(range(store.num_shards)) if shards is None else set(shards)
        self.sketch = {s: SpaceSaving(capacity) for s in self.shards}

    def observe(self, keys: np.ndarray, shards: np.ndarray) -> None:
        """Packed row keys updated this step and the shard of each."""
        for s in self.shards:
            mine = keys[shards == s]
            if len(mine):
                self.sketch[s].defer(mine)

    @property
    def pending_n(self) -> int:
        return max(sk.pending_n for sk in self.sketch.values())

    def take(self) -> dict[int, list[np.ndarray]]:
        """Per shard, the keys observed since the last merge (to ``merge`` off the training path)."""
        return {s: sk.take() for s, sk in self.sketch.items()}

    def merge(self, chunks: dict[int, list[np.ndarray]]) -> None:
        for s, c in chunks.items():
            self.sketch[s].merge(c)

    def select(self, shard: int, budget: int, merge: bool = True) -> list[tuple[int, np.ndarray]]:
        """The shard's ``budget`` most counted rows as [(table, sorted ids)]. ``merge=False``: from the
        keys merged so far alone (on the merging thread, while the training thread adds more)."""
        keys, counts = self.sketch[shard].top(budget, merge)
        return _top(keys, counts, budget)


class SSUTracker(MFUTracker):
    """Each shard's most sampled rows: each update is tracked with probability ``fraction``, and
    the sampled stream is counted by the same bounded sketch as MFU (``capacity`` rows per shard)."""

    def __init__(
        self, store: RedisStore, fraction: float, capacity: int, seed: int = 0, shards: set[int] | None = None
    ) -> None:
        super().__init__(store, capacity, shards)
        self.fraction = fraction
        self.rng = np.random.default_rng([seed, 4242])

    def observe(self, keys: np.ndarray, shards: np.ndarray) -> None:
        sampled = self.rng.random(len(keys)) < self.fraction
        if sampled.any():
            super().observe(keys[sampled], shards[sampled])


def _top(keys: np.ndarray, counts: np.ndarray, budget: int) -> list[tuple[int, np.ndarray]]:
    if len(keys) > budget:
        idx = np.argpartition(-counts, budget - 1)[:budget]
        keys = keys[idx]
    keys = np.sort(keys)
    tables, rows = rowkeys.unpack(keys)
    return [(int(t), rows[tables == t]) for t in np.unique(tables).tolist()]


class PrioritySaver(ShardRowsSaver):
    """A writer's priority saves of the shards it writes, taken off the training path.

    ``save`` copies each shard's selected rows (weights and optimizer state) from the rows this
    trainer holds, which is all the training path waits for; a background thread writes
    ``{dir}/shard{S}.bin`` (temp, fsync, rename). No barrier: the writer of a shard is its only
    writer, so its rows at a step boundary are the shard's. ``half`` stores weights as float16.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        store: RedisStore,
        tracker,
        budget: int,
        counts: RowCounts | None = None,
        shards: set[int] | None = None,
        half: bool = False,
    ) -> None:
        super().__init__(directory, store, shards, "priority")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.tracker, self.budget = tracker, budget
        self.counts = counts if counts is not None else RowCounts()
        self.half = half
        self.saved_rows: dict[int, list[tuple[int, np.ndarray]]] = {}  # shard -> [(table, ids)] of the newest save
        self.saved_step: dict[int, int] = {}  # shard -> the step of the newest save
        self.num_saves = 0
        self._prepared: Future | None = None  # the next save's rows, being picked on the writer thread

    MERGE_EVERY = 1 << 18  # observed keys handed to the writer thread to merge (bounds memory)

    MERGE_SKETCH = 1 << 14  # observed keys per shard handed to the writer thread to merge into the sketch

    def observe(self, keys: np.ndarray, shards: np.ndarray) -> None:
        """Packed row keys updated this step (any shard: only this writer's are kept) and their shards."""
        keys, shards = self.mine_keys(keys, shards)
        self.tracker.observe(keys, shards)
        self.counts.observe(keys)
        if self.counts.pending_n > self.MERGE_EVERY:
            chunks = self.counts.take()
            self.writer.run(lambda: self.counts.merge(chunks))
        if self.tracker.pending_n > self.MERGE_SKETCH:  # the sketch's merge: off the path as well
            pending = self.tracker.take()
            self.writer.run(lambda: self.tracker.merge(pending))

    def prepare(self) -> None:
        """Work out the next save's rows on the writer thread, a step or more before ``save``: the
        keys observed so far merged into the tracker, each shard's top rows picked and grouped. The
        save then only copies them; the rows picked are those counted up to this call."""
        pending = self.tracker.take()
        self._prepared = self.writer.run(lambda: self._select(pending))

    def _select(self, pending: dict[int, list[np.ndarray]] | None = None) -> tuple:
        if pending is not None:
            self.tracker.merge(pending)
        sel = {
            s: {t: ids for t, ids in self.tracker.select(s, self.budget, merge=pending is None) if len(ids)}
            for s in sorted(self.shards)
        }
        tables = sorted({t for per in sel.values() for t in per})
        # one gather of every shard's and table's rows (held rows), then each shard's part of it
        keys, order = rowkeys.from_tables(
            {t: np.concatenate([per[t] for per in sel.values() if t in per]) for t in tables}
        )
        return sel, tables, keys, order

    def on_checkpoint(self, step: int) -> None:
        self.counts.take()  # counted before the checkpoint: it holds them
        self.writer.run(self.counts.reset)

    def save(self, step: int) -> int:
        """Copy this writer's shards' selected rows as of now (at a step boundary) and hand them to
        the background writer; -> rows saved. Rows read here come from the held rows (a shard
        restored since is read from Redis)."""
        prepared, self._prepared = self._prepared, None
        if prepared is not None:  # picked by ``prepare`` on the writer thread, after the previous save's write
            sel, tables, keys, order = prepared.result()
        else:  # not prepared: picked here, once the writer is idle (the previous save is on disk)
            self.writer.wait()
            sel, tables, keys, order = self._select()
        total = 0
        dims = [spec.dim for spec in self.store.tables.specs]
        # [n, width], in key order: the pause. Held rows by one gather; rows not held (evicted, or
        # a restored shard's not read back yet) by the lazy init or from Redis
        held = self.store.read_keys(keys)
        chunks = self.counts.take()

        def write() -> None:  # in the background: the update counts, then one file per shard
            self.counts.merge(chunks)
            flat = np.empty_like(held)
            flat[order] = held  # back to the tables' concatenation order
            rows, lo = {}, 0
            for t in tables:
                n = sum(len(per[t]) for per in sel.values() if t in per)
                rows[t], lo = flat[lo : lo + n], lo + n
            offset = dict.fromkeys(tables, 0)
            for s, per in sel.items():
                groups = []
                for t, ids in per.items():
                    groups.append((t, ids, rows[t][offset[t] : offset[t] + len(ids)]))
                    offset[t] += len(ids)
                saved = self.counts.total(list(per.items()))
                self.writer.write(layout.priority_save(self.dir, s), step, saved, groups, dims, self.half)

        self.writer.run(write)
        for s, per in sel.items():
            self.saved_rows[s] = list(per.items())
            self.saved_step[s] = step
            total += sum(len(ids) for ids in per.values())
        self.num_saves += 1
        return total

    def exact_rows(self, shard: int, step: int) -> np.ndarray | None:
        """Packed keys of this writer's save of ``shard`` at ``step``, if that is its newest and holds
        the rows exactly as they were (not float16): an overlay of it wrote the values the writer
        held then. None otherwise."""
        if self.half or self.saved_step.get(shard) != step:
            return None
        rows = self.saved_rows.get(shard, [])
        return np.sort(np.concatenate([rowkeys.pack(t, ids) for t, ids in rows])) if rows else None


def overlay(
    directory: Path,
    store: RedisStore,
    shard: int,
    after_step: int,
    upto: int,
    on_corrupt: Callable[[CorruptCheckpointError], None] = lambda e: None,
) -> tuple[int, int, int]:
    """Write the shard's newest priority save if taken after ``after_step`` and at ``upto`` or
    before (by any trainer); -> (bytes, updates it saved, its step or ``after_step``). A save that
    fails its CRC is not overlaid (``on_corrupt`` is told): the updates it held are counted lost."""
    path = layout.priority_save(directory, shard)
    if not path.exists():
        return 0, 0, after_step
    data = path.read_bytes()
    try:
        f = rowfiles.decode(data, f"priority save {path}")
    except CorruptCheckpointError as e:
        on_corrupt(e)
        return 0, 0, after_step
    if not after_step < f.step <= upto:
        return 0, 0, after_step
    if f.groups:
        store.lay_rows(shard, f.groups, step=None)
    return len(data), f.updates, f.step


def drop_after(directory: Path, step: int) -> int:
    """Remove priority saves taken after ``step`` (an earlier run's, or steps a restart took back);
    -> files removed."""
    n = 0
    for path in layout.priority_saves(directory):
        try:
            newer = rowfiles.read(path).step > step
        except (OSError, CorruptCheckpointError):
            newer = True  # unreadable: never overlaid
        if newer:
            path.unlink(missing_ok=True)
            n += 1
    return n

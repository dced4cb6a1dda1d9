"""CPR's priority saves: between full checkpoints, save each shard's most valuable rows more often.

- ``MFUTracker`` (partial-mfu): exact access counters per row (memory grows with the rows);
  the rows to save are each shard's most frequently updated.
- ``SSUTracker`` (partial-ssu): sub-sampled update tracking in bounded memory: each update is
  tracked with probability ``fraction`` (so a row updated k times is tracked with probability
  1 - (1 - fraction)^k: hot rows almost surely), and each shard keeps at most ``capacity`` tracked
  rows, the most sampled ones.

``PrioritySaver`` writes the selected rows (weights and optimizer state) of every shard to
``{dir}/shard{S}.bin`` at a step boundary (temp, fsync, rename; CRC32C checked on load). On a
partial recovery the newest save taken after the restored checkpoint is overlaid on the shard;
the updates those rows received between the checkpoint and the save are no longer lost.
``RowCounts`` keeps per-row update counts since the last checkpoint to account for exactly that.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import crc32c
import numpy as np

from embeddings import rowkeys
from embeddings.redis_store import RedisStore, decode_groups, encode_groups
from recovery.errors import CorruptCheckpointError


class RowCounts:
    """Updates per row since the last checkpoint (accounting of what a priority save holds)."""

    def __init__(self, num_rows: list[int]) -> None:
        self.counts = [np.zeros(n, dtype=np.int32) for n in num_rows]

    def observe(self, t: int, ids: np.ndarray) -> None:
        self.counts[t][ids] += 1  # ids are unique within a step

    def reset(self) -> None:
        for c in self.counts:
            c[:] = 0

    def total(self, groups: list[tuple[int, np.ndarray]]) -> int:
        return int(sum(self.counts[t][ids].sum() for t, ids in groups))


class MFUTracker:
    def __init__(self, store: RedisStore) -> None:
        self.store = store
        self.counts = [np.zeros(t.num_rows, dtype=np.int64) for t in store.tables]

    def observe(self, t: int, ids: np.ndarray) -> None:
        self.counts[t][ids] += 1

    def select(self, shard: int, budget: int) -> list[tuple[int, np.ndarray]]:
        keys, counts = [], []
        for t, c in enumerate(self.counts):
            ids = np.flatnonzero(c)
            ids = ids[self.store.shard_map.shard_of(t, ids) == shard]
            keys.append(rowkeys.pack(t, ids))
            counts.append(c[ids])
        return _top(np.concatenate(keys), np.concatenate(counts), budget)


class SSUTracker:
    def __init__(self, store: RedisStore, fraction: float, capacity: int, seed: int = 0) -> None:
        self.store = store
        self.fraction = fraction
        self.capacity = capacity
        self.rng = np.random.default_rng([seed, 4242])
        n = store.num_shards
        self.keys = [np.empty(0, np.int64) for _ in range(n)]
        self.counts = [np.empty(0, np.int64) for _ in range(n)]

    def observe(self, t: int, ids: np.ndarray) -> None:
        sampled = ids[self.rng.random(len(ids)) < self.fraction]
        if not len(sampled):
            return
        owner = self.store.shard_map.shard_of(t, sampled)
        for s in np.unique(owner).tolist():
            k = np.concatenate([self.keys[s], rowkeys.pack(t, sampled[owner == s])])
            c = np.concatenate([self.counts[s], np.ones(int((owner == s).sum()), np.int64)])
            uk, inv = np.unique(k, return_inverse=True)
            uc = np.bincount(inv, weights=c).astype(np.int64)
            if len(uk) > self.capacity:  # bounded: keep the most updated
                keep = np.argpartition(-uc, self.capacity - 1)[: self.capacity]
                uk, uc = uk[keep], uc[keep]
            self.keys[s], self.counts[s] = uk, uc

    def select(self, shard: int, budget: int) -> list[tuple[int, np.ndarray]]:
        return _top(self.keys[shard], self.counts[shard], budget)


def _top(keys: np.ndarray, counts: np.ndarray, budget: int) -> list[tuple[int, np.ndarray]]:
    if len(keys) > budget:
        idx = np.argpartition(-counts, budget - 1)[:budget]
        keys = keys[idx]
    keys = np.sort(keys)
    tables, rows = rowkeys.unpack(keys)
    return [(int(t), rows[tables == t]) for t in np.unique(tables).tolist()]


class PrioritySaver:
    """Rank 0's writer of priority saves, and their overlay on a restored shard."""

    def __init__(
        self, directory: str | os.PathLike, store: RedisStore, tracker, budget: int, counts: RowCounts
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.store, self.tracker, self.budget, self.counts = store, tracker, budget, counts
        self.saved: dict[int, tuple[int, int]] = {}  # shard -> (step, updates the saved rows held)
        self.saved_rows: dict[int, list[tuple[int, np.ndarray]]] = {}  # shard -> [(table, ids)] of the newest save
        self.bytes_written = 0
        self.num_saves = 0

    def observe(self, t: int, ids: np.ndarray) -> None:
        self.tracker.observe(t, ids)
        self.counts.observe(t, ids)

    def on_checkpoint(self, step: int) -> None:
        self.counts.reset()

    def save(self, step: int) -> int:
        """Save every shard's selected rows as of now (call at a step boundary); returns rows saved."""
        total = 0
        for s in range(self.store.num_shards):
            sel = self.tracker.select(s, self.budget)
            groups = [
                (t, ids, self.store.read_rows(self.store.tables.specs[t].name, ids)) for t, ids in sel if len(ids)
            ]
            blob = encode_groups(step, groups)
            path = self.dir / f"shard{s}.bin"
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "wb") as f:
                f.write(struct.pack("<I", crc32c.crc32c(blob)) + blob)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self.saved[s] = (step, self.counts.total([(t, ids) for t, ids, _ in groups]))
            self.saved_rows[s] = [(t, ids) for t, ids, _ in groups]
            self.bytes_written += len(blob) + 4
            total += sum(len(ids) for _, ids, _ in groups)
        self.num_saves += 1
        return total

    def overlay(self, shard: int, after_step: int) -> tuple[int, int]:
        """Write the shard's newest save if taken after ``after_step``; -> (bytes, updates it saved)."""
        if shard not in self.saved or self.saved[shard][0] <= after_step:
            return 0, 0
        path = self.dir / f"shard{shard}.bin"
        data = path.read_bytes()
        (crc,) = struct.unpack_from("<I", data)
        if crc32c.crc32c(data[4:]) != crc:
            raise CorruptCheckpointError(f"priority save {path}: CRC32C mismatch; not loaded")
        _, groups = decode_groups(data[4:])
        if groups:
            self.store.write_shard(shard, groups, step=None)
        return len(data), self.saved[shard][1]

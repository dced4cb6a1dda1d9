"""Incremental flushes (``--recovery incremental``): compact durability between checkpoints.

In the spirit of Check-N-Run's differential checkpoints: each writer remembers which rows of its
shards were updated since its last flush, and every ``flush_every`` steps writes each such row
once, as it is now (weights and optimizer state), to ``{dir}/shard{S}/flush_{step:010d}.bin``.
The rows are copied from the rows the writer holds at the step boundary; a background thread
writes the file (``recovery.durable.rowfiles``), so training pauses for the copy alone. A row updated in
every step of the interval is written once, where the update log writes it every step.

Recovery restores the shard's checkpoint and overlays every flush taken after it, in order: the
shard is then exactly as of the last flush, and only the updates since it are lost (counted like
``partial``'s). Flushes that every kept checkpoint covers are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from embeddings import rowkeys
from embeddings.store.redis_store import RedisStore
from recovery.durable import layout, rowfiles
from recovery.durable.files import fsync_dir
from recovery.durable.rowfiles import ShardRowsSaver
from recovery.errors import CorruptCheckpointError


class Flusher(ShardRowsSaver):
    """One writer's flushes of the shards it writes."""

    def __init__(self, directory: str | Path, store: RedisStore, shards: set[int], half: bool = False) -> None:
        super().__init__(directory, store, shards, "flush")
        self.half = half
        for s in self.shards:
            layout.flush_shard_dir(self.dir, s).mkdir(parents=True, exist_ok=True)
        # one flag per row of each table (a byte, like the held rows' state): dirty since the last flush
        self._dirty = [np.zeros(spec.num_rows, bool) for spec in store.tables.specs]
        self.num_flushes = 0
        self.suspended = False

    def observe(self, keys: np.ndarray, shards: np.ndarray) -> None:
        """Packed row keys updated this step (any shard: only this writer's are kept) and their shards."""
        keys, _ = self.mine_keys(keys, shards)
        for t, (ids, _lo, _hi) in rowkeys.table_groups(keys).items():
            self._dirty[t][ids] = True

    def _clean(self) -> None:
        for d in self._dirty:
            d[:] = False

    def suspend(self) -> None:
        """After a trainer restart the rows dirtied before it are unknown: no flush until the next
        checkpoint (a flush that missed them would claim rows it does not hold)."""
        self.suspended = True
        self._clean()

    def on_checkpoint(self, step: int) -> None:
        if self.suspended:  # the checkpoint holds every row as of ``step``: the chain starts again
            self.suspended = False
            self._clean()

    def flush(self, step: int) -> int:
        """Copy every row dirtied since the last flush and hand it to the background writer; -> rows."""
        if self.suspended:
            return 0
        self.writer.wait()  # flushes land in order, and the previous one is whole before the next
        by_table = {}
        for t, d in enumerate(self._dirty):
            ids = np.flatnonzero(d)
            if len(ids):
                by_table[t] = ids
                d[ids] = False
        # the pause: one gather of the rows held (no Redis read); keys in table order are sorted
        keys = (
            np.concatenate([rowkeys.pack(t, ids) for t, ids in by_table.items()]) if by_table else np.empty(0, np.int64)
        )
        held = self.store.read_keys(keys)
        dims = [spec.dim for spec in self.store.tables.specs]

        def write() -> None:  # in the background: split by shard, encode, write
            rows = {t: held[lo:hi] for t, (_, lo, hi) in rowkeys.table_groups(keys).items()}
            groups: dict[int, list] = {s: [] for s in self.shards}
            for t, tids in by_table.items():
                for s, pos in enumerate(self.store.shard_map.split(t, tids)):
                    if len(pos) and s in groups:
                        groups[s].append((t, tids[pos], rows[t][pos]))
            for s in sorted(self.shards):
                self.writer.write(layout.flush_file(self.dir, s, step), step, 0, groups[s], dims, self.half)

        self.writer.run(write)
        self.num_flushes += 1
        return sum(len(ids) for ids in by_table.values())


def flush_files(directory: Path, shard: int, after_step: int, upto: int | None = None) -> list[Path]:
    """The shard's flush files of steps after ``after_step`` (and at ``upto`` or before), oldest first."""
    files = layout.flush_files(directory, shard)
    steps = [layout.flush_step(f) for f in files]
    return [f for f, s in zip(files, steps) if after_step < s and (upto is None or s <= upto)]


def replay(
    directory: Path,
    store: RedisStore,
    shard: int,
    after_step: int,
    upto: int,
    on_corrupt: Callable[[CorruptCheckpointError], None] = lambda e: None,
) -> tuple[int, int]:
    """Overlay the shard's flushes taken after ``after_step`` and at ``upto`` or before, oldest
    first. -> (bytes read, the step the shard is now as of). A flush that fails its CRC ends the
    replay there (``on_corrupt`` is told): each flush holds only the rows dirtied since the one
    before, so the shard stays as of the last good one, and the updates since are counted lost."""
    nbytes, as_of = 0, after_step
    for path in flush_files(directory, shard, after_step, upto):
        try:
            f = rowfiles.read(path)
        except CorruptCheckpointError as e:
            on_corrupt(e)
            break
        if f.groups:
            store.lay_rows(shard, f.groups, step=f.step)
        nbytes += path.stat().st_size
        as_of = f.step
    return nbytes, as_of


def drop_before(directory: Path, num_shards: int, step: int) -> int:
    """Remove flushes that a checkpoint at ``step`` (the oldest kept) covers; -> files removed."""
    n = 0
    for s in range(num_shards):
        d = layout.flush_shard_dir(directory, s)
        old = [f for f in layout.flush_files(directory, s) if layout.flush_step(f) <= step]
        for f in old:
            f.unlink(missing_ok=True)
        if old:
            fsync_dir(d)
        n += len(old)
    return n


def drop_after(directory: Path, num_shards: int, step: int) -> int:
    """Remove flushes taken after ``step`` (an earlier run's, or steps a restart took back); -> files removed."""
    n = 0
    for s in range(num_shards):
        for f in flush_files(directory, s, step):
            f.unlink(missing_ok=True)
            n += 1
    return n

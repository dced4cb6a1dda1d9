"""The store front's side of what this trainer keeps in memory: the rows it holds (its row cache,
``embeddings.store.row_cache``) and what a restore leaves of them, the rows of shards away while
recovery restores them (the outage recovery owns and attaches, ``embeddings.store.outage``), and
the write path's counters. Each call goes to the part that does it (``RedisStore``'s ``cache``,
``reads``, ``writes``); callers reach none of them."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from embeddings.store.markers import Markers
from embeddings.store.outage import OutageRows
from embeddings.store.present import PresentRows
from embeddings.store.reads import RowReads
from embeddings.store.row_cache import HeldRows, RowCache
from embeddings.store.row_space import RowSpace
from embeddings.store.writes import RowWrites


class CacheFront:
    """Mixed into ``RedisStore``: the parts below are its own."""

    space: RowSpace
    cache: RowCache
    present: PresentRows
    markers: Markers
    reads: RowReads
    writes: RowWrites

    # -- the rows this trainer holds --------------------------------------------------------------
    @property
    def row_cache(self) -> HeldRows | None:
        """The rows this trainer holds (None: none, before ``hold_rows``)."""
        return self.cache.held

    def row_cache_stats(self) -> dict | None:
        """The held rows' slots, reads served, rows evicted (``HeldRows.stats``); None: none held."""
        held = self.row_cache
        return None if held is None else held.stats()

    def hold_rows(self, shards: set[int], budget_bytes: int) -> HeldRows:
        """Keep the rows of ``shards`` (the ones this process writes) in memory as they are written."""
        return self.cache.hold_rows(shards, budget_bytes)

    def assume_fresh(self) -> None:
        """A fresh run: a held shard that never applied a step holds none of its rows yet (``RowCache.assume_fresh``)."""
        self.cache.assume_fresh(self.markers.applied_step)

    def learn_present(self, step: int | None = None) -> None:
        """A resumed run: the rows on each held shard listed in the background, so that a row not on
        its shard is known never written without a read (``embeddings.store.present``). ``step``:
        where the resume brought every shard, for a cache taken from the trainer before in this
        process (``RowCache.resumed``): only the shards it does not know are listed."""
        shards = self.cache.resumed(step) if step is not None else None
        if shards is None or shards:
            self.present.start(shards)

    def stop_learning(self) -> None:
        """A shard failed: the listing of a resumed run learns nothing from now on (``PresentRows.stop``)."""
        self.present.stop()

    def present_stats(self) -> dict:
        """What the last listing of a resumed run learned, once it ended (``PresentRows.stats``)."""
        self.present.wait()
        return self.present.stats()

    def reload_held(
        self,
        shard: int,
        kept_upto: int | None = None,
        absent_after: int | None = None,
        overlay: tuple[np.ndarray, int] | None = None,
    ) -> int:
        """After a shard was restored: its held rows read back, or held again where the restore's
        steps tell (``RowCache.reload_held``). -> rows read."""
        return self.cache.reload_held(shard, self.reads.fetch, kept_upto, absent_after, overlay)

    def reinstate_held(self, shard: int) -> int:
        """The shard was restored to exactly what this writer wrote: its rows held again, no read."""
        return self.cache.reinstate_held(shard)

    def drop_held_restore(self, shard: int) -> None:
        """The rows of ``shard`` its restore forgot are not held again (``RowCache.drop_forgotten``)."""
        self.cache.drop_forgotten(shard)

    def held_shard_rows(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """A copy of the rows held of ``shard``: (packed keys, rows [n, width])."""
        return self.cache.shard_rows(shard, self.space.width(0))

    def hold_written(
        self, keys: np.ndarray, rows: np.ndarray, shards: np.ndarray, step: int, pin: bool = False
    ) -> None:
        """Rows handed to a write-behind held at once (``RowWrites.hold_written``)."""
        self.writes.hold_written(keys, rows, shards, step, pin)

    def initial_rows(self, keys: np.ndarray) -> np.ndarray:
        """The initial rows [n, width] of packed keys of one row width (``RowSpace.initial_rows``)."""
        return self.space.initial_rows(keys)

    # -- the shards away (``--train-through``) ----------------------------------------------------
    def attach_outage(self, outage: OutageRows | None) -> None:
        """Recovery's outage rows (``embeddings.store.outage``): reads of the shards it has away are
        answered by it from now on; its owner (``recovery.restore.through``) keeps it."""
        self.reads.attach_outage(outage)

    @property
    def outage_active(self) -> bool:
        """A shard is away: its rows are the attached outage's (the outage's own ``active``)."""
        outage = self.reads.outage
        return outage is not None and outage.active

    def away_mask(self, keys: np.ndarray) -> np.ndarray | None:
        """A mask of ``keys`` whose shards are away (None: none is)."""
        outage = self.reads.outage
        return outage.split(keys) if outage is not None else None

    def update_away(self, keys: np.ndarray, new: np.ndarray, grads: np.ndarray, step: int) -> np.ndarray:
        """A step's updated rows of shards away (``OutageRows.update``); -> the mask of exact rows."""
        outage = self.reads.outage
        assert outage is not None, "update_away with no outage attached"
        return outage.update(keys, new, grads, step)

    def serve_away(
        self,
        keys: np.ndarray,
        training: bool,
        all_gather_keys: Callable | None = None,
        all_reduce_sum: Callable | None = None,
    ) -> None:
        """The step's rows of shards away, the same on every trainer (``OutageRows.serve``; with the
        collectives where several trainers run); nothing while none is away."""
        outage = self.reads.outage
        if outage is None or not outage.active:
            return
        away = outage.split(keys)
        mine = keys[away] if away is not None else keys[:0]
        if all_gather_keys is not None:
            outage.serve(mine, all_gather_keys, all_reduce_sum, training=training)
        else:
            outage.serve(mine, training=training)

    # -- counters (``StoreCounters``) -------------------------------------------------------------
    @property
    def behind_wait_s(self) -> float:
        """The training path waiting at the commit point of a write-behind."""
        return self.writes.behind_wait_s

    @property
    def rows_written(self) -> int:
        """Rows the training steps' writes put on their shards."""
        return self.writes.rows_written

    @property
    def reload_s(self) -> float:
        """Reading held rows back after their shard was restored."""
        return self.cache.reload_s

    @property
    def reload_kept(self) -> int:
        """Held rows of restored shards held again without a read."""
        return self.cache.reload_kept

    @property
    def reload_absent(self) -> int:
        """Held rows of restored shards known never written."""
        return self.cache.reload_absent

    @property
    def reload_read(self) -> int:
        """Held rows of restored shards read back."""
        return self.cache.reload_read

    def write_nowhere(self) -> None:
        """A benchmark's ceiling (``RECSYS_ROWS_NOWHERE=1``): row writes built, never sent."""
        self.writes.write_nowhere()

"""The store's side of the rows a trainer holds (``embeddings.store.row_cache.HeldRows``): starting to hold
the rows of the shards it writes, a fresh run's shards known empty, and what a restore of a shard
leaves of them. One ``Holding`` per ``RedisStore`` (``store.holding``); the rows themselves are
``store.held``."""

from __future__ import annotations

import time

import numpy as np

from embeddings.errors import ShardUnavailableError
from embeddings.store.row_cache import HeldRows


class Holding:
    def __init__(self, store) -> None:
        self.store = store

    def hold_rows(self, shards: set[int], budget_bytes: int) -> HeldRows:
        """Keep the rows of ``shards`` (the ones this process writes) in memory as they are written."""
        st = self.store
        widths = [st.width(t) for t in range(len(st.tables.specs))]
        st.held = HeldRows(
            st.tables,
            widths,
            shards,
            budget_bytes,
            owner_of=st.shard_map.shard_of,
            init=st.reads.initial_rows,  # held tables share one row width, hence one dim
            owner_of_keys=st.shard_map.shard_of_keys,
            num_shards=st.num_shards,
        )
        return st.held

    def assume_fresh(self) -> None:
        """A fresh run: the held shards that never applied a step hold none of its rows yet, so a row
        of theirs this writer has not written is known absent (no first read from Redis). A shard
        that does not answer now is assumed nothing of: its rows are read from it (the recovery
        protocol meets its failure at the first such read), as another rank may already be in a
        phase that killed it."""
        st = self.store
        if st.held is None:
            return
        fresh = set()
        for s in sorted(st.held.shards):
            try:
                if st.applied_step(s) is None:
                    fresh.add(s)
            except ShardUnavailableError:
                continue
        if fresh:
            st.held.assume_fresh(fresh)

    def reload_held(
        self,
        shard: int,
        kept_upto: int | None = None,
        absent_after: int | None = None,
        overlay: tuple[np.ndarray, int] | None = None,
    ) -> int:
        """After a shard was restored: read back the rows this writer held on it (one bulk read), so
        that the steps after the recovery read them from memory again and its write-behind keeps
        overlapping them; rows no longer on the shard are known never written. With the restore's
        steps (``HeldRestores.restored``), rows unchanged by it are held again without a read and
        rows first written after it are known never written. -> rows read."""
        st = self.store
        if st.held is None or shard not in st.held.shards:
            return 0
        t0 = time.perf_counter()
        restores = st.held.restores
        if kept_upto is None or absent_after is None:
            restores.drop_forgotten(shard)
        else:
            kept, gone = restores.restored(shard, kept_upto, max(kept_upto, absent_after), overlay)
            st.reload_kept += kept
            st.reload_absent += gone
        requests = restores.unknown(shard)
        if requests:
            st.reads.fetch(requests)
        st.reload_s += time.perf_counter() - t0
        n = sum(len(ids) for ids in requests.values())
        st.reload_read += n
        return n

    def reinstate_held(self, shard: int) -> int:
        """After a shard was restored to exactly what this writer wrote to it (its log replayed up to
        the writer's last step): the rows it held there are held again, no read. -> rows held again."""
        held = self.store.held
        if held is None or shard not in held.shards:
            return 0
        return held.restores.reinstate(shard)

"""The store front's per-shard upkeep, for recovery: applied markers and rollback, snapshots taken
and loaded, rows laid on a shard being restored, its connections renewed, its replica promoted,
the eviction checks. Each call goes to the part that does it (``RedisStore``'s ``markers``,
``snapshots``, ``writes``, ``links``, ``evictions``); callers reach none of them."""

from __future__ import annotations

import numpy as np
import redis

from embeddings.net.links import ShardLinks
from embeddings.snapshots.keys import Snapshots
from embeddings.store.evictions import EvictionWatch
from embeddings.store.markers import Markers
from embeddings.store.writes import RowWrites

Groups = list[tuple[int, np.ndarray, np.ndarray]]  # (table index, ids, rows [n, width])


class ShardUpkeep:
    """Mixed into ``RedisStore``: the parts below are its own."""

    links: ShardLinks
    writes: RowWrites
    markers: Markers
    snapshots: Snapshots
    evictions: EvictionWatch

    # -- markers ----------------------------------------------------------------------------------
    def applied_step(self, shard: int) -> int | None:
        """The last step whose update this shard applied (None: never)."""
        return self.markers.applied_step(shard)

    def applied_steps(self) -> list[int | None]:
        """Per shard: the last step whose update it applied (None: never)."""
        return self.markers.applied_steps()

    def stamp(self, shard: int) -> int | None:
        """Before a snapshot of ``shard``: its identity key set (``Markers.stamp``); -> its applied marker."""
        return self.markers.stamp(shard)

    def rollback(self, shard: int, to_step: int) -> int:
        """Back to ``to_step`` (``Markers.rollback``). Returns rows restored."""
        return self.markers.rollback(shard, to_step)

    # -- a shard's keys as a whole ----------------------------------------------------------------
    def snapshot(self, shard: int, dest, timeout_s: float = 600.0):
        """A ``NetworkSnapshot`` of one shard into ``dest``; ``start()`` it at the snapshot point."""
        return self.snapshots.snapshot(shard, dest, timeout_s)

    def load_snapshot(self, shard: int, path) -> int:
        """This namespace's keys of the RDB file at ``path`` onto one shard, over the protocol: one
        full synchronization, one ``RESTORE`` per key, else (a server that refuses both, said in one
        line) one HSET per bucket (``embeddings.snapshots.restore_load``); -> the bytes sent."""
        from embeddings.snapshots.restore_load import load_snapshot

        return load_snapshot(self, self.links, shard, path)

    def clear_shard(self, shard: int) -> int:
        """Delete every key of this namespace on one shard; returns how many."""
        return self.snapshots.clear_shard(shard)

    # -- rows laid by a restore -------------------------------------------------------------------
    def write_shard(self, shard: int, groups: Groups, step: int | None) -> int:
        """Rows (table index, ids, rows) onto one shard, with its applied marker (``RowWrites.write_shard``)."""
        return self.writes.write_shard(shard, groups, step)

    def lay_rows(self, shard: int, groups: Groups, step: int | None, chunk_rows: int = 65_536) -> int:
        """Rows laid on a shard being restored, pipelined in chunks (``RowWrites.lay_rows``); -> rows written."""
        return self.writes.lay_rows(shard, groups, step, chunk_rows)

    # -- another process serves the shard ---------------------------------------------------------
    def reconnect(self, shard: int) -> None:
        """Its server was replaced: new connections from the next call (its held rows forgotten)."""
        self.links.reconnect(shard)

    def failover(self, shard: int) -> None:
        """Serve the shard from its promoted replica (``ShardLinks.failover``)."""
        self.links.failover(shard)

    def promote(self, shard: int) -> None:
        """Promote the shard's replica and serve the shard from it (``ShardLinks.promote``)."""
        self.links.promote(shard)

    def has_replica(self, shard: int) -> bool:
        return self.links.has_replica(shard)

    def wait_replicated(self, shard: int, timeout_ms: int = 1000) -> int:
        """``WAIT 1``: the shard's writes so far reached its replica (``ShardLinks.wait_replicated``)."""
        return self.links.wait_replicated(shard, timeout_ms)

    def client(self, shard: int) -> redis.Redis:
        """The shard's control client (not the row socket)."""
        return self.links.client(shard)

    # -- eviction checks --------------------------------------------------------------------------
    def watch_evictions(self) -> None:
        """At connect: refuse a shard whose policy can evict rows; note each one's ``evicted_keys``."""
        self.evictions.watch()

    def check_evictions(self, resume: str | None = None, why_not: str = "") -> None:
        """At a commit point: a server that evicted rows of the run stops it (``EvictionWatch.check``)."""
        self.evictions.check(resume, why_not)

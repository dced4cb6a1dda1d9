"""A shard's keys as a whole: its snapshot taken over the network, a snapshot loaded back over the
protocol (``embeddings.snapshots.restore_load``, which the store front calls), and every key of the
namespace deleted. One ``Snapshots`` per ``RedisStore``, given the shards' links and key names."""

from __future__ import annotations

from collections.abc import Callable

from embeddings.net.links import ShardLinks
from embeddings.store.row_space import RowSpace


def _chunks(it, n):
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


class Snapshots:
    def __init__(self, links: ShardLinks, space: RowSpace, forget: Callable[[int | None], None]) -> None:
        """``forget(shard)``: the writer's held rows of a shard cleared go (None: every shard's)."""
        self.links, self.space, self.forget = links, space, forget

    def snapshot(self, shard: int, dest, timeout_s: float = 600.0):
        """A ``NetworkSnapshot`` of one shard into ``dest``; ``start()`` it at the snapshot point."""
        from embeddings.snapshots.rdb import NetworkSnapshot

        def info() -> dict:
            return self.links.call(shard, lambda c: c.info("persistence"))

        links = self.links
        return NetworkSnapshot(links.pools[shard], info, dest, shard, links.endpoints[shard], timeout_s)

    def clear_shard(self, shard: int) -> int:
        """Delete every key of this namespace on one shard; returns how many."""
        self.forget(shard)
        return self.links.mapped(shard, lambda: self.unlink(shard))

    def clear(self) -> int:
        """Delete every key of this namespace on every shard; returns how many."""
        self.forget(None)
        work = {s: (lambda s=s: self.unlink(s)) for s in range(len(self.links.clients))}
        return sum(self.links.on_shards(work).values())

    def unlink(self, shard: int) -> int:
        c, n = self.links.clients[shard], 0
        for batch in _chunks(c.scan_iter(match=self.match(shard), count=10_000), 10_000):
            n += c.unlink(*batch)
        return n

    def match(self, shard: int) -> str:
        """SCAN pattern of a shard's keys (a cluster tag's braces are literal in a pattern)."""
        return self.space.key_namespace(shard).replace("[", "\\[") + ":*"

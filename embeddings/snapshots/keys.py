"""A shard's keys as a whole: its snapshot taken over the network, a snapshot loaded back over the
protocol (``embeddings.snapshots.restore_load``, which the store front calls), every row on it
listed, and every key of the namespace deleted. One ``Snapshots`` per ``RedisStore``, given the shards' links and key names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain

import numpy as np

from embeddings.net.links import ShardLinks
from embeddings.net.wire import RowConnection, key_commands
from embeddings.store.buckets import KEY_ID_BYTES, BucketLayout
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

    def present_rows(
        self, shard: int, layout: BucketLayout, values: bool = False
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """Every row of this namespace on one shard, a batch of buckets at a time: (table, row ids,
        their rows [n, width] with ``values``, else None). Its buckets are found by ``SCAN`` of its
        hashes, their fields by ``HKEYS`` (``HGETALL`` with ``values``), sent in one write a batch on
        a connection of the listing's own (``RowConnection.replies``: no redis-py command objects,
        a third of the listing's CPU). Not mapped (``ShardLinks.mapped``): a client error is raised
        as is; a field of no row of this layout raises ValueError."""
        c = self.links.clients[shard]
        wire = RowConnection(self.links.pools[shard], self.links.timeout_s)
        head = len(self.space.key_namespace(shard)) + 1
        row_bytes, tables = self.space.row_bytes(), len(self.space.tables.specs)
        verb = b"HGETALL" if values else b"HKEYS"
        try:
            for batch in _chunks(c.scan_iter(match=self.match(shard), count=10_000, _type="hash"), 2_000):
                yield from self._listed(batch, head, tables, layout, row_bytes, verb, wire)
        finally:
            wire.close()

    def _listed(
        self, batch: list[bytes], head: int, tables: int, layout: BucketLayout, row_bytes, verb: bytes, wire
    ) -> Iterator[tuple[int, np.ndarray, np.ndarray | None]]:
        """One ``SCAN`` batch of bucket keys, their rows listed a table at a time (``present_rows``)."""
        by_table: dict[int, list[tuple[int, bytes]]] = {}
        for key in batch:
            table, sep = key[head : -KEY_ID_BYTES - 1], key[-KEY_ID_BYTES - 1 : -KEY_ID_BYTES]
            if sep == b":" and table.isdigit() and int(table) < tables:
                by_table.setdefault(int(table), []).append((int.from_bytes(key[-KEY_ID_BYTES:], "big"), key))
        for t, buckets in by_table.items():
            replies = wire.replies(key_commands(verb, [key for _, key in buckets]), len(buckets))
            fields = [r[0::2] for r in replies] if verb == b"HGETALL" else replies
            ids = layout.bucket_row_ids([b for b, _ in buckets], fields, row_bytes[t])
            rows = None
            if verb == b"HGETALL":
                blob = b"".join(chain.from_iterable(r[1::2] for r in replies))
                if len(blob) != len(ids) * row_bytes[t]:
                    raise ValueError(f"a row of table {t} is not {row_bytes[t]} bytes")
                rows = np.frombuffer(blob, np.float32).reshape(len(ids), row_bytes[t] // 4)
            yield t, ids, rows

    def match(self, shard: int) -> str:
        """SCAN pattern of a shard's keys (a cluster tag's braces are literal in a pattern)."""
        return self.space.key_namespace(shard).replace("[", "\\[") + ":*"

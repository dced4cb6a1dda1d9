"""The Redis-backed store: rows sharded over several ``redis-server`` processes.

Layout (``embeddings.store.buckets``): rows sit in Redis hashes of ``span`` consecutive row ids, key
``{namespace}:{table_index}:`` followed by ``row // span`` as 8 bytes big-endian, field
``row % span`` (1 or 2 bytes), value the row's ``[dim + state]`` little-endian float32 bytes
(fixed width per table); each hash stays a listpack on the server, about 1.2x the rows' bytes
against 2.5x for a string per row. Bulk reads and writes go through ``embeddings.net.wire``
(numpy-encoded pipelined HGET/HSET); reads of several shards run in parallel from a thread pool
(socket I/O releases the GIL), a step's writes are sent to every shard before any reply is read
(``write_step``). A server keeps the hashes compact only under its ``hash-max-listpack-*`` limits:
the store raises them with ``CONFIG SET`` before its first write to a server, and where that is
refused, warns once (one line) and writes on: the rows are exact, only bigger.

Per shard, bookkeeping keys ``{namespace}:meta:applied`` (the last step whose update the shard
applied) and ``{namespace}:meta:undo`` (that step's rows as they were before it, for a rollback of
one step after a trainer restart).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import redis

from embeddings.errors import ShardUnavailableError
from embeddings.net.links import ConnectionOptions, ShardLinks
from embeddings.optim import RowOptimizer
from embeddings.peer_rows import PeerFront
from embeddings.shard_map import ShardMap
from embeddings.snapshots.keys import Snapshots
from embeddings.store.base import IdsByTable, StoreBase
from embeddings.store.buckets import BucketLayout
from embeddings.store.cache_front import CacheFront
from embeddings.store.evictions import EvictionWatch
from embeddings.store.markers import Markers, decode_groups, encode_groups
from embeddings.store.present import PresentRows
from embeddings.store.reads import RowReads
from embeddings.store.row_cache import RowCache
from embeddings.store.row_space import RowSpace
from embeddings.store.shard_upkeep import ShardUpkeep
from embeddings.store.writes import RowWrites
from embeddings.tables import TableSet

__all__ = [
    "ConnectionOptions",
    "RedisStore",
    "decode_groups",
    "encode_groups",
]  # the undo record codec, as before the split

T = TypeVar("T")


class RedisStore(CacheFront, PeerFront, ShardUpkeep, StoreBase):
    """Rows of every table, sharded over Redis endpoints by a ``ShardMap``.

    ``urls`` are ``redis://`` or ``rediss://`` (TLS) URLs, optionally with ``user:password@``.
    Every call is bounded by ``timeout_s``; a shard that is dead or does not answer in time raises
    ``ShardUnavailableError`` (or its subclass ``ShardTimeoutError``) naming shard and endpoint.
    ``connect`` (``ConnectionOptions``): ``connection_kwargs`` pass through to ``redis.Redis`` (e.g.
    ``ssl_ca_certs``); ``replica_urls``, one per shard, its replica.

    The store is in parts, one job each, each given what it works on (never the store); this class
    puts them together behind the interface the trainer and recovery use, and owns them:
    - ``links`` (``embeddings.net.links``): connections, reconnects, failover, the error mapping;
    - ``space`` (``embeddings.store.row_space``): key names, row widths, the lazy init;
    - ``cache`` (``embeddings.store.row_cache.RowCache``): the rows this trainer holds, and what a
      restore leaves of them (front: ``embeddings.store.cache_front``); with several trainers also
      the rows it keeps of the others' shards (front: ``embeddings.peer_rows``);
    - ``reads`` (``embeddings.store.reads``): the row reads (the rows of shards away from the outage
      recovery attaches, ``attach_outage``);
    - ``writes`` (``embeddings.store.writes``): a step's write, write-behind, rows laid by a restore;
    - ``markers`` (``embeddings.store.markers``): applied markers, undo records, rollback;
    - ``snapshots`` (``embeddings.snapshots.keys``): a shard's keys as a whole (snapshot, clear);
    - ``evictions`` (``embeddings.store.evictions``): the eviction and policy checks.
    Per-shard upkeep for recovery (markers, snapshots, restores, reconnects) is
    ``embeddings.store.shard_upkeep``.
    """

    def __init__(
        self,
        urls: Sequence[str],
        tables: TableSet,
        optimizer: RowOptimizer,
        *,
        namespace: str = "recsys",
        seed: int = 0,
        placement: str = "row",
        timeout_s: float = 5.0,
        connect: ConnectionOptions | None = None,
    ) -> None:
        super().__init__(tables, optimizer, seed)
        if not urls:
            raise ValueError("RedisStore needs at least one shard URL")
        if not namespace or any(c in namespace for c in ": \t\n"):
            raise ValueError(f"namespace {namespace!r} must be non-empty without ':' or spaces")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.shard_map = ShardMap(tables, len(urls), placement)  # type: ignore[arg-type]
        # a bucket's rows are hashed over every shard (``row`` placement), so its span grows with them
        self.layout = BucketLayout(spread=len(urls) if placement == "row" else 1)
        self.restore_refused: dict[str, str] = {}  # endpoint -> why it refused RESTORE (load_snapshot)
        self.sync_refused: dict[str, str] = {}  # endpoint -> why it did not load a snapshot as a sync
        self.warn: Callable[[str], None] = lambda line: print(line, file=sys.stderr)
        # a shard served by another process from now on: the writer's held rows of it go (``cache``)
        connect = connect or ConnectionOptions()
        self.links = ShardLinks(
            urls,
            namespace,
            self.layout,
            timeout_s,
            connect.connection_kwargs,
            connect.replica_urls,
            lambda s: self.cache.forget(s),
        )
        links = self.links  # the lists below are the links' own (a failover changes them in place)
        self.cluster, self.urls, self.endpoints, self.replica_urls = (
            links.cluster,
            links.urls,
            links.endpoints,
            links.replica_urls,
        )
        self.space = RowSpace(namespace, links.tags, tables, optimizer, seed)
        self.cache = RowCache(self.space, self.shard_map, len(urls))
        self.writes = RowWrites(links, self.space, self.shard_map, self.cache, lambda line: self.warn(line))
        self.reads = RowReads(
            links,
            self.space,
            self.shard_map,
            self.cache,
            self.writes.bulk,
            lambda keys: StoreBase.read_keys(self, keys),
        )
        self.markers = Markers(links, self.space, self.cache.forget, self.writes.fit)
        self.snapshots = Snapshots(links, self.space, self.cache.forget)
        self.evictions = EvictionWatch(links, self.space)
        self.present = PresentRows(
            self.cache, links, self.layout, self.snapshots, self.markers, self._away, lambda line: self.warn(line)
        )

    def _away(self) -> set[int]:
        outage = self.reads.outage
        return set(outage.away) if outage is not None else set()

    @property
    def num_shards(self) -> int:
        return len(self.links.clients)

    def key_namespace(self, shard: int) -> str:
        """What a shard's keys start with: the namespace, or on a cluster its hash tag ``{ns.S.J}``."""
        return self.space.key_namespace(shard)

    def prefix(self, table_index: int, shard: int) -> bytes:
        return self.space.prefix(table_index, shard)

    def meta_key(self, name: str, shard: int) -> bytes:
        """A per-shard bookkeeping key of this namespace (not a row: rows have 8 binary id bytes)."""
        return self.space.meta_key(name, shard)

    def key(self, table_index: int, row: int) -> bytes:
        """The Redis key of one row: its bucket (a hash; the row is its field ``location(...)[1]``)."""
        return self.location(table_index, row)[0]

    def location(self, table_index: int, row: int) -> tuple[bytes, bytes]:
        """(key, field) of one row: the hash of its bucket and its field there."""
        shard = int(self.shard_map.shard_of(table_index, np.array([row]))[0])
        return self.layout.location(self.prefix(table_index, shard), int(row), 4 * self.width(table_index))

    # -- StoreBase hooks and the row path ---------------------------------------------------------
    def _fetch(self, requests: IdsByTable):
        return self.reads.fetch(requests)

    def _store(self, requests, step=None, undo=None):
        """Plain rows (``write_rows``, ``update_many``). A training step's write, with its applied
        marker and undo record, goes through ``_store_keys`` -> ``RowWrites.write_step``."""
        if step is not None:
            raise ValueError("RedisStore writes a step's rows with apply_keys(keys, grads, step)")
        self.writes.plain(requests)

    def read_keys(self, keys: np.ndarray) -> np.ndarray:
        return self.reads.read_keys(keys)

    def _store_keys(self, keys, rows, step=None, undo=None) -> None:
        failed = self.write_step(keys, rows, self.shard_map.shard_of_keys(keys), step, undo)
        if failed:
            raise next(iter(failed.values()))

    def write_step(self, keys, rows, shards, step: int | None = None, undo=None) -> dict[int, ShardUnavailableError]:
        """A training step's rows written now, on every shard at once (``RowWrites.write_step``).
        -> the shards that failed, with their error; the others are written (and held)."""
        return self.writes.write_step(keys, rows, shards, step, undo)

    def write_behind(self, keys, rows, shards, step: int, undo, before=None, window: bool = False, after=None) -> None:
        """See ``RowWrites.write_behind``; ``join_behind`` is its commit point."""
        self.writes.write_behind(keys, rows, shards, step, undo, before, window, after)

    def join_behind(self) -> dict[int, ShardUnavailableError]:
        """The commit point of the last ``write_behind``: waits for it. -> the shards that failed."""
        return self.writes.join_behind()

    def from_redis(self):
        """Reads inside go to the shards even for held rows (``RowReads.from_redis``)."""
        return self.reads.from_redis()

    # -- per shard ------------------------------------------------------------------------------
    def call(self, shard: int, fn: Callable[[redis.Redis], T]) -> T:
        """Run ``fn(client)`` on one shard with the store's error mapping."""
        return self.links.call(shard, fn)

    def endpoint(self, shard: int) -> str:
        return self.endpoints[shard]

    def ping(self) -> list[bool]:
        """Per shard: True when it answers PING within the timeout."""
        out = []
        for s, c in enumerate(self.links.clients):
            try:
                out.append(bool(self.links.mapped(s, c.ping)))
            except ShardUnavailableError:
                out.append(False)
        return out

    # -- maintenance ---------------------------------------------------------------------
    def clear(self) -> int:
        """Delete every key of this namespace on every shard; returns how many."""
        return self.snapshots.clear()

    def close(self) -> None:
        self.present.close()
        self.writes.close()
        self.links.close()
        # a trainer built again in this process takes its cache (none with a shard away: its rows are the outage's)
        self.cache.release(carry=not self._away())

"""Row -> shard placement. Pure functions, no I/O.

Two placements:

- ``table``: whole tables go to shards. Tables are placed greedily, largest first, on the shard
  holding the fewest bytes so far (ties to the lowest shard index), so the map is deterministic.
- ``row``: every row is hashed independently, ``shard = mix64(table_index, row) % num_shards``;
  a table's hot rows spread over all shards, which is what makes a single shard's failure cost
  only a fraction of every table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

from data.hashing import GOLDEN, keyed_hash, mix64
from embeddings import rowkeys
from embeddings.tables import TableSet

Placement = Literal["table", "row"]
PLACEMENTS: tuple[str, ...] = ("table", "row")


def row_hash(table_index: int, ids: np.ndarray) -> np.ndarray:
    """A 64-bit hash of (table, row) per id; [n] uint64."""
    return keyed_hash(table_index, ids)


def place_tables(sizes: list[int], num_shards: int) -> list[int]:
    """Greedy largest-first placement of tables with the given byte sizes; returns shard per table."""
    load = [0] * num_shards
    owner = [0] * len(sizes)
    for t in sorted(range(len(sizes)), key=lambda t: (-sizes[t], t)):
        s = min(range(num_shards), key=lambda s: (load[s], s))
        owner[t] = s
        load[s] += sizes[t]
    return owner


@dataclass(frozen=True)
class ShardMap:
    tables: TableSet
    num_shards: int
    placement: Placement = "row"

    def __post_init__(self) -> None:
        if self.num_shards <= 0:
            raise ValueError(f"num_shards={self.num_shards} must be > 0")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement={self.placement!r} must be one of {PLACEMENTS}")
        sizes = [t.num_rows * t.dim for t in self.tables]
        object.__setattr__(self, "_table_owner", place_tables(sizes, self.num_shards))
        # each table's hash seed (``data.hashing.keyed_hash_many``'s), looked up per key: a step's keys
        # are hashed without a sort of their tables
        with np.errstate(over="ignore"):
            seeds = mix64((np.arange(len(self.tables), dtype=np.uint64) + np.uint64(1)) * GOLDEN)
        object.__setattr__(self, "_table_seed", seeds)

    def shard_of(self, table_index: int, ids: np.ndarray) -> np.ndarray:
        """Shard index per row id; [n] int64."""
        ids = np.asarray(ids, dtype=np.int64)
        if self.placement == "table":
            return np.full(ids.shape, self._table_owner[table_index], dtype=np.int64)
        return (row_hash(table_index, ids) % np.uint64(self.num_shards)).astype(np.int64)

    def shard_of_keys(self, keys: np.ndarray) -> np.ndarray:
        """Shard index per packed row key (``embeddings.rowkeys``), all tables in one pass; [n] int64.
        Equal to ``shard_of`` table by table."""
        tables, ids = rowkeys.unpack(np.asarray(keys, np.int64))
        if self.placement == "table":
            return np.asarray(self._table_owner, np.int64)[tables]
        hashed = mix64(ids.astype(np.uint64) ^ self._table_seed[tables])
        return (hashed % np.uint64(self.num_shards)).astype(np.int64)

    def split(self, table_index: int, ids: np.ndarray) -> list[np.ndarray]:
        """Positions into ``ids`` per shard: ``out[s]`` indexes the ids that live on shard s."""
        owner = self.shard_of(table_index, ids)
        if self.placement == "table":
            s = self._table_owner[table_index]
            return [np.arange(len(ids)) if i == s else np.empty(0, np.int64) for i in range(self.num_shards)]
        order = np.argsort(owner, kind="stable")
        counts = np.bincount(owner, minlength=self.num_shards)
        return np.split(order, np.cumsum(counts)[:-1])

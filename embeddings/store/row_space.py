"""Where a store's rows are and what they are: each shard's key names (namespace, or a cluster's hash
tag), each table's row width, and the rows' initial values (the lazy init). Fixed at connect; one
``RowSpace`` per ``RedisStore``, given to each of its parts that names keys or sizes rows."""

from __future__ import annotations

import numpy as np

from embeddings import rowkeys
from embeddings.optim import RowOptimizer, initial_state, state_of
from embeddings.rowinit import init_rows_keys
from embeddings.tables import TableSet


class RowSpace:
    def __init__(
        self, namespace: str, tags: list[str] | None, tables: TableSet, optimizer: RowOptimizer, seed: int
    ) -> None:
        """``tags``: a Redis Cluster's hash tag per shard (None: the namespace names every shard's keys)."""
        self.namespace, self.tags = namespace, tags
        self.tables, self.optimizer, self.seed = tables, optimizer, seed
        self._scales = np.array([spec.scale for spec in tables], np.float32)  # lazy init per table

    def width(self, table_index: int) -> int:
        """Floats per row of a table: its weights and optimizer state."""
        dim = self.tables.specs[table_index].dim
        return dim + state_of(self.optimizer, dim)

    def row_bytes(self) -> list[int]:
        """Bytes per row of each table (a hash field's value)."""
        return [4 * self.width(t) for t in range(len(self.tables.specs))]

    def key_namespace(self, shard: int) -> str:
        """What a shard's keys start with: the namespace, or on a cluster its hash tag ``{ns.S.J}``."""
        return self.namespace if self.tags is None else "{" + self.tags[shard] + "}"

    def prefix(self, table_index: int, shard: int) -> bytes:
        return f"{self.key_namespace(shard)}:{table_index}:".encode()

    def meta_key(self, name: str, shard: int) -> bytes:
        """A per-shard bookkeeping key of this namespace (not a row: rows have 8 binary id bytes)."""
        return f"{self.key_namespace(shard)}:meta:{name}".encode()

    def initial_rows(self, keys: np.ndarray) -> np.ndarray:
        """The initial rows [n, width] of packed keys of tables of one row width (lazy-init weights,
        the optimizer's initial state)."""
        t = int(keys[0] >> rowkeys.ROW_BITS) if len(keys) else 0
        dim = self.tables.specs[t].dim
        rows = np.full((len(keys), self.width(t)), initial_state(self.optimizer), np.float32)
        rows[:, :dim] = init_rows_keys(self.seed, keys, dim, self._scales)
        return rows

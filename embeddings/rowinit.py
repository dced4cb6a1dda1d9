"""Lazy, deterministic row initialisation.

A row that was never written has the value ``init_rows(seed, table_index, ids, dim, scale)``:
uniform in ``[-scale, scale)``, a pure function of (seed, table, row, column). A 10^8-row table
therefore needs no bulk load, and every store (Redis or in-process) agrees on untouched rows.
"""

from __future__ import annotations

import numpy as np

from embeddings.shard_map import _GOLDEN, mix64, row_hash


def init_rows(seed: int, table_index: int, ids: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """[n, dim] float32 initial weights for ``ids`` of one table."""
    ids = np.asarray(ids, dtype=np.int64)
    with np.errstate(over="ignore"):
        base = row_hash(table_index, ids) ^ mix64(np.array([seed], dtype=np.uint64) + _GOLDEN)
        cols = np.arange(dim, dtype=np.uint64) * _GOLDEN
        bits = mix64(base[:, None] + cols[None, :])
    # top 24 bits -> [0, 1) exactly representable in float32
    u = (bits >> np.uint64(40)).astype(np.float32) * np.float32(1.0 / (1 << 24))
    return (u * np.float32(2.0) - np.float32(1.0)) * np.float32(scale)

"""Lazy, deterministic row initialisation.

A row that was never written has the value ``init_rows(seed, table_index, ids, dim, scale)``:
uniform in ``[-scale, scale)``, a pure function of (seed, table, row, column). A 10^8-row table
therefore needs no bulk load, and every store (Redis or in-process) agrees on untouched rows.
"""

from __future__ import annotations

import numpy as np

from data.hashing import hash_uniform
from embeddings import rowkeys


def init_rows(seed: int, table_index: int, ids: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """[n, dim] float32 initial weights for ``ids`` of one table."""
    # one key per (seed, table): distinct seeds or tables give unrelated rows
    u = hash_uniform(seed * 1_000_003 + table_index, np.asarray(ids, dtype=np.int64), dim)
    return (u * np.float32(2.0) - np.float32(1.0)) * np.float32(scale)


def init_rows_keys(seed: int, keys: np.ndarray, dim: int, scales: np.ndarray) -> np.ndarray:
    """[n, dim] float32 initial weights of packed row keys of any tables (``scales``: float32 per
    table), in one pass; equal to ``init_rows`` table by table."""
    tables, ids = rowkeys.unpack(np.asarray(keys, np.int64))
    u = hash_uniform(np.int64(seed) * 1_000_003 + tables, ids, dim)
    return (u * np.float32(2.0) - np.float32(1.0)) * scales[tables][:, None]

"""Lazy, deterministic row initialisation.

A row that was never written has the value ``init_rows(seed, table_index, ids, dim, scale)``:
uniform in ``[-scale, scale)``, a pure function of (seed, table, row, column). A 10^8-row table
therefore needs no bulk load, and every store (Redis or in-process) agrees on untouched rows.
"""

from __future__ import annotations

import numpy as np

from data.hashing import hash_uniform


def init_rows(seed: int, table_index: int, ids: np.ndarray, dim: int, scale: float) -> np.ndarray:
    """[n, dim] float32 initial weights for ``ids`` of one table."""
    # one key per (seed, table): distinct seeds or tables give unrelated rows
    u = hash_uniform(seed * 1_000_003 + table_index, np.asarray(ids, dtype=np.int64), dim)
    return (u * np.float32(2.0) - np.float32(1.0)) * np.float32(scale)

"""One packing of (table index, row id) into one int64 key, for numpy arrays and torch tensors.

A row id fits in ``ROW_BITS`` bits (10^12 rows per table); the table index sits above it. Keys sort
by table, then row, so a sorted key array groups each table's rows together.
"""

from __future__ import annotations

import numpy as np

ROW_BITS = 40
ROW_MASK = (1 << ROW_BITS) - 1


def pack(table: int, ids):
    """Keys of rows ``ids`` (numpy int array or torch int64 tensor) of table ``table``."""
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False) | (int(table) << ROW_BITS)
    return ids | (int(table) << ROW_BITS)


def unpack(keys):
    """-> (table indices, row ids), each the type of ``keys``."""
    return keys >> ROW_BITS, keys & ROW_MASK
